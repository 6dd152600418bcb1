"""The configuration matrix, the sweep registry, peers' availability, and build_engine's shared models."""

import dataclasses

import pytest

from fastdecode.bench.config import BenchConfig, ModelCache, build_engine
from fastdecode.bench.matrix import MatrixSpec, build_matrix
from fastdecode.bench.peers import PEERS
from fastdecode.bench.sweeps import SWEEPS, register_sweep, sweep_configs
from fastdecode.errors import ConfigError


def names(configs):
    return [c.name for c in configs]


def test_baseline_always_first_and_drafter_settings_expand():
    configs = build_matrix(
        MatrixSpec(models=("m",), drafters=("ngram", "prompt-lookup"), ngram_ns=(3, 5), draft_ks=(4, 7))
    )
    assert names(configs) == [
        "none",
        "ngram N=3 K=4",
        "ngram N=3 K=7",
        "ngram N=5 K=4",
        "ngram N=5 K=7",
        "prompt-lookup K=4",
        "prompt-lookup K=7",
    ]
    assert configs[0].is_baseline
    ngram = configs[2]
    assert ngram.drafter_options == {"n": 3, "k": 7} and ngram.generation_options["draft_k"] == 7
    assert ngram.generation_options["max_new_tokens"] == 128 and ngram.generation_options["temperature"] == 0.0


def test_draft_quants_expand_the_draft_model_drafter_only():
    configs = build_matrix(
        MatrixSpec(
            models=("m",),
            drafters=("ngram", "draft-model"),
            draft_ks=(4,),
            draft_quants=("none", "gguf"),
            draft_model="small",
        )
    )
    assert names(configs) == ["none", "ngram N=5 K=4", "draft-model K=4", "draft-model gguf K=4"]
    assert configs[3].drafter_options == {"draft_quant": "gguf", "draft_model": "small"}
    assert configs[1].drafter_options == {"n": 5, "k": 4}


def test_models_and_dtypes_form_groups():
    configs = build_matrix(MatrixSpec(models=("a", "b"), dtypes=("float32", "bfloat16"), drafters=("none",)))
    assert [(c.model, c.dtype) for c in configs] == [
        ("a", "float32"),
        ("a", "bfloat16"),
        ("b", "float32"),
        ("b", "bfloat16"),
    ]
    assert all(c.is_baseline for c in configs)


def test_ngram_nk_sweep_is_50_points_and_merges_with_the_main_config():
    configs = build_matrix(MatrixSpec(models=("m",), drafters=("none", "ngram"), sweeps=("ngram-nk",)))
    swept = [c for c in configs if c.sweep == "ngram-nk"]
    assert len(swept) == 50 and len(configs) == 51  # N=5 K=7 measured once
    assert {(c.sweep_point["N"], c.sweep_point["K"]) for c in swept} == {
        (n, k) for n in range(2, 7) for k in range(1, 11)
    }
    main = next(c for c in configs if c.name == "ngram N=5 K=7")
    assert main.featured and main.sweep_point == {"N": 5, "K": 7}
    assert sum(c.featured for c in configs) == 2


def test_adding_a_sweep_is_one_registered_function():
    @register_sweep("k-only")
    def k_only(base):
        return [
            dataclasses.replace(
                base,
                name=f"pl K={k}",
                drafter="prompt-lookup",
                drafter_options={"k": k},
                sweep="k-only",
                sweep_point={"N": 0, "K": k},
                featured=False,
            )
            for k in (1, 2)
        ]

    try:
        configs = build_matrix(MatrixSpec(models=("m",), drafters=("none",), sweeps=("k-only",)))
        assert names(configs) == ["none", "pl K=1", "pl K=2"]
    finally:
        SWEEPS.unregister("k-only")


def test_peers_expand_per_k():
    configs = build_matrix(
        MatrixSpec(models=("m",), drafters=("none",), draft_ks=(3, 7), peers=("hf", "hf-prompt-lookup", "llama-cpp"))
    )
    assert names(configs) == [
        "none",
        "hf generate",
        "hf prompt-lookup K=3",
        "hf prompt-lookup K=7",
        "llama.cpp",
        "llama.cpp prompt-lookup K=3",
        "llama.cpp prompt-lookup K=7",
    ]
    assert all(c.drafter == "none" for c in configs) and not any(c.is_baseline for c in configs[1:])


def test_peer_availability_notes():
    cfg = BenchConfig(name="x", model="some/hub-model", peer="hf-assisted", peer_options={"k": 5})
    assert "draft model" in PEERS.get("hf-assisted").unavailable(cfg)
    assert PEERS.get("hf-assisted").unavailable(dataclasses.replace(cfg, draft_model="d")) is None
    reason = PEERS.get("llama-cpp").unavailable(dataclasses.replace(cfg, peer="llama-cpp"))
    assert reason in ("llama-cpp-python is not installed", "some/hub-model is not a GGUF model")


@pytest.mark.parametrize(
    "spec, message",
    [
        (MatrixSpec(models=("m",), drafters=("none", "magic")), "unknown drafter 'magic'"),
        (MatrixSpec(models=("m",), peers=("vllm",)), "unknown peer 'vllm'"),
        (MatrixSpec(models=("m",), sweeps=("nope",)), "unknown sweep 'nope'"),
        (MatrixSpec(models=("m",), ngram_ns=(1,)), "--ngram-n"),
        (MatrixSpec(models=("m",), draft_ks=(0,)), "--draft-k"),
        (MatrixSpec(models=("m",), drafters=("draft-model",), draft_quants=("q3",)), "unknown draft quantization 'q3'"),
        (MatrixSpec(models=()), "no model"),
    ],
)
def test_bad_matrix_is_a_config_error(spec, message):
    with pytest.raises(ConfigError, match=message):
        build_matrix(spec)


def test_unknown_sweep_lists_the_registry():
    with pytest.raises(ConfigError, match="ngram-nk"):
        sweep_configs("nope", BenchConfig(name="none", model="m"))


def test_build_engine_shares_one_model_per_model_and_dtype(tiny_model_dir, monkeypatch):
    import fastdecode.bench.config as config_module

    loads = []
    real = config_module.load_model
    monkeypatch.setattr(config_module, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    cache = ModelCache()
    configs = build_matrix(MatrixSpec(models=(str(tiny_model_dir),), draft_ks=(2, 3)))
    engines = [build_engine(c, cache) for c in configs]
    assert len(loads) == 1
    assert len({id(e.model) for e in engines}) == 1
    assert len({id(e.target) for e in engines}) == 1  # one target (fused native weights) for the whole group
    hf = build_engine(dataclasses.replace(configs[0], backend="hf"), cache)
    assert hf.target.name == "hf" and hf.model is engines[0].model and len(loads) == 1
    assert [e.drafter_name for e in engines] == ["none", "ngram", "ngram", "prompt-lookup", "prompt-lookup"]
    assert engines[2].config.draft_k == 3 and engines[2].drafter.n == 5


def test_backends_and_weights_form_groups_with_peers_measured_once():
    configs = build_matrix(
        MatrixSpec(
            models=("m",), backends=("hf", "native"), weights=("float", "int4"), drafters=("ngram",), peers=("hf",)
        )
    )
    baselines = [(c.backend, c.weights) for c in configs if c.is_baseline]
    assert baselines == [("hf", "float"), ("hf", "int4"), ("native", "float"), ("native", "int4")]
    assert sum(1 for c in configs if c.drafter == "ngram") == 4
    assert sum(1 for c in configs if c.peer is not None) == 1


def test_float_kernels_expand_only_native_float_and_int8_targets():
    spec = MatrixSpec(
        models=("m",),
        backends=("native", "hf"),
        weights=("float", "int8", "int4"),
        float_kernels=("auto", "torch"),
        drafters=("none",),
    )
    targets = [(c.backend, c.weights, c.float_kernel) for c in build_matrix(spec)]
    assert targets == [
        ("native", "float", "auto"),
        ("native", "float", "torch"),
        ("native", "int8", "auto"),
        ("native", "int8", "torch"),
        ("native", "int4", "auto"),
        ("hf", "float", "auto"),
        ("hf", "int8", "auto"),
        ("hf", "int4", "auto"),
    ]
    assert len({c.group_key for c in build_matrix(spec)}) == 8  # each its own baseline
