"""``EngineArgs``: a parser round-trips it, its checks are one clear error, every front end takes its
flags from it, the drafter flags come from the drafter registry, and it builds the engine."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from fastdecode.args import BATCHING_OPTIONS, DRAFTER_OPTIONS, GROUPS, MODEL_OPTIONS, EngineArgs
from fastdecode.cli.commands import build_parser
from fastdecode.drafters.base import BUILDERS, DRAFTERS, Draft, Drafter, register_builder, register_drafter
from fastdecode.drafters.factory import DrafterOptions
from fastdecode.errors import ConfigError

ALL = ("model", "drafter", "batching")


def _parser(groups=ALL, **options) -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(), groups, **options)


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_the_defaults_of_a_parser_are_the_fields_defaults():
    assert EngineArgs.from_cli_args(_parser().parse_args([])) == EngineArgs()


def test_a_command_line_round_trips():
    argv = [
        "--model",
        "m",
        "--dtype",
        "bfloat16",
        "--device",
        "cuda",
        "--trust-remote-code",
        "--backend",
        "hf",
        "--weights",
        "int8",
        "--float-kernel",
        "torch",
        "--kv-cache-dtype",
        "float16",
        "--drafter",
        "layer-skip",
        "--draft-k",
        "3",
        "--adaptive-k",
        "--draft-tree",
        "auto",
        "--draft-quant",
        "int4",
        "--exit-layer",
        "2",
        "--skip-layers",
        "1,3",
        "--max-num-seqs",
        "4",
        "--kv-cache-gb",
        "0.5",
        "--long-prefill-token-threshold",
        "32",
    ]
    args = EngineArgs.from_cli_args(_parser().parse_args(argv))
    assert args == EngineArgs(
        model="m",
        dtype="bfloat16",
        device="cuda",
        trust_remote_code=True,
        backend="hf",
        weights="int8",
        float_kernel="torch",
        kv_cache_dtype="float16",
        drafter="layer-skip",
        draft_k=3,
        adaptive_k=True,
        draft_tree="auto",
        draft_quant="int4",
        exit_layer=2,
        skip_layers=(1, 3),
        max_num_seqs=4,
        kv_cache_gb=0.5,
        long_prefill_token_threshold=32,
    )
    args.validate()
    assert args.drafter_options() == DrafterOptions(
        name="layer-skip", k=3, draft_quant="int4", exit_layer=2, skip_layers=(1, 3)
    )
    config = args.generation_config(max_new_tokens=5)
    assert (config.draft_k, config.adaptive_k, config.draft_tree, config.max_new_tokens) == (3, True, "auto", 5)


def test_overrides_and_flagless_options():
    args = EngineArgs.from_cli_args(argparse.Namespace(weights="q4_0", other=1), max_num_seqs=2, block_size=32)
    assert (args.weights, args.max_num_seqs, args.block_size) == ("q4_0", 2, 32)
    assert "--block-size" not in _flags(_parser())  # an option of the Python API only
    assert set(args.batching()) == {
        "max_num_seqs",
        "max_num_batched_tokens",
        "long_prefill_token_threshold",
        "kv_cache_gb",
        "num_kv_blocks",
        "block_size",
        "enable_prefix_caching",
        "time_slice_tokens",
    }


def test_the_engine_keywords_default_as_the_engines_do():
    import inspect

    from fastdecode.engine import Engine

    params = inspect.signature(Engine).parameters
    assert {name: params[name].default for name in EngineArgs().batching()} == EngineArgs().batching()


@pytest.mark.parametrize(
    "options, weights",
    [
        ({}, "auto"),  # make_target resolves it on the model: a GGUF file's own blocks on the native decoder
        ({"drafter": "ngram"}, "auto"),
        ({"drafter": "hybrid", "draft_model": "other.gguf"}, "auto"),  # another model drafts: the target is free
        ({"backend": "hf"}, "float"),  # transformers runs the float model
        ({"drafter": "layer-skip"}, "float"),  # drafts with the target's own layers
        ({"drafter": "draft-model", "draft_quant": "gguf"}, "float"),  # its own blocks drafting for its float model
        ({"drafter": "hybrid", "draft_quant": "q8_0"}, "float"),
        ({"weights": "gguf", "drafter": "layer-skip"}, "gguf"),  # an explicit --weights always wins
        ({"weights": "q8_0", "backend": "hf"}, "q8_0"),
        ({"weights": "float"}, "float"),
    ],
)
def test_auto_weights_are_float_where_the_options_need_float(options, weights):
    assert EngineArgs().weights == "auto"
    assert EngineArgs(**options).target_weights() == weights


def test_auto_is_a_weights_choice_of_every_front_end():
    assert EngineArgs.choices("weights")[0] == "auto"
    assert _parser().parse_args([]).weights == "auto"
    assert _parser().parse_args(["--weights", "gguf"]).weights == "gguf"


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"ngram_n": 3}, r"--ngram-n is an option of the ngram, recycling and hybrid drafters, not of 'none'"),
        (
            {"drafter": "prompt-lookup", "ngram_min_prob": 0.5},
            r"--ngram-min-prob is an option of the ngram drafter, not of 'prompt-lookup'",
        ),
        ({"adaptive_k": True}, r"choose a --drafter"),
        ({"draft_tree": 2}, r"choose a --drafter"),
        (
            {"drafter": "ngram", "draft_quant": "int8"},
            r"--draft-model/--draft-quant apply to the draft-model and hybrid drafters, not 'ngram'",
        ),
        (
            {"drafter": "ngram", "exit_layer": 2},
            r"--exit-layer/--skip-layers apply to the layer-skip drafter, not 'ngram'",
        ),
        ({"drafter": "layer-skip", "draft_model": "x"}, r"layer-skip drafts with the target's own layers"),
        ({"drafter": "layer-skip", "draft_quant": "q4_0"}, r"--draft-quant int8\|int4 only"),
        ({"drafter": "draft-model", "draft_quant": "int3"}, r"unknown draft quantization 'int3'"),
    ],
)
def test_contradicting_options_are_one_config_error(options, pattern):
    with pytest.raises(ConfigError, match=pattern) as exc:
        EngineArgs(**options).validate()
    assert "\n" not in str(exc.value)


def test_an_unknown_drafter_lists_the_choices():
    with pytest.raises(ConfigError, match=r"unknown drafter 'bogus'; choose from: .*ngram"):
        EngineArgs(drafter="bogus").drafter_options().build()


# ---------------------------------------------------------------- the front ends


def test_generate_and_serve_take_every_flag_as_declared():
    declared = _flags(_parser())
    for command in ("generate", "serve"):
        flags = _flags(_subparser(command))
        for flag, action in declared.items():
            if flag in ("-h", "--help"):
                continue
            assert flag in flags, (command, flag)
            mine = flags[flag]
            assert (mine.choices, mine.type, mine.help, mine.metavar) == (
                action.choices,
                action.type,
                action.help,
                action.metavar,
            )
            if not (command == "serve" and flag in ("--long-prefill-token-threshold", "--time-slice-tokens")):
                assert mine.default == action.default, (command, flag)
    assert _subparser("serve").get_default("long_prefill_token_threshold") == 64
    assert _subparser("serve").get_default("time_slice_tokens") == 32


@pytest.mark.parametrize(
    "command, options",
    [
        ("demo", MODEL_OPTIONS),
        (
            "bench",
            (
                "model",
                "dtype",
                "device",
                "backend",
                "weights",
                "float_kernel",
                "kv_cache_dtype",
                "trust_remote_code",
                "ngram_n",
                "draft_k",
                "adaptive_k",
                "cost_aware_k",
                "draft_tree",
                "draft_model",
                "draft_quant",
            ),
        ),
        ("throughput", ("model", "dtype", "device", "weights", "float_kernel", "kv_cache_dtype", "draft_tree")),
        ("probe", ("model", "dtype", "backend", "weights", "float_kernel", "kv_cache_dtype")),
        ("bench-serve", ("model", "weights", "drafter")),
    ],
)
def test_every_front_end_has_the_shared_flags(command, options):
    flags = _flags(_subparser(command))
    for name in options:
        assert "--" + name.replace("_", "-") in flags, (command, name)
    for name in ("kv_cache_dtype", "weights", "drafter"):
        action = flags.get("--" + name.replace("_", "-"))
        if action is not None and action.choices is not None:  # the plain form: the registry's choices
            assert tuple(action.choices) == EngineArgs.choices(name)


def test_the_sweep_form_is_a_comma_list_under_the_same_name():
    bench = _flags(_subparser("bench"))
    assert bench["--drafters"].default == "none,ngram,prompt-lookup" and bench["--model"].default is None
    assert bench["--draft-k"].type("3,5") == [3, 5] and bench["--weights"].choices is None
    probe = _subparser("probe")
    assert (probe.get_default("backend"), probe.get_default("weights")) == ("hf,native", "float,int8,int4")


def test_the_groups_cover_every_flag():
    flagged = {f.name for f in dataclasses.fields(EngineArgs) if "flag" in f.metadata}
    assert (
        flagged
        == set(MODEL_OPTIONS) | set(DRAFTER_OPTIONS) | set(BATCHING_OPTIONS)
        == {n for g in GROUPS.values() for n in g}
    )


# ---------------------------------------------------------------- the drafter registry


class _Echo(Drafter):
    name = "echo-test"

    def __init__(self, k: int = 1, n: int = 2) -> None:
        self.k, self.n = k, n

    def propose(self, context, k):
        return Draft(list(context[-1:]) * min(k, self.k))


@pytest.fixture
def echo_drafter():
    register_drafter("echo-test")(_Echo)
    register_builder("echo-test", reads=("ngram_n",))(
        lambda options, target=None: _Echo(k=options.k, n=options.ngram_n)
    )
    yield
    DRAFTERS.unregister("echo-test")
    BUILDERS.unregister("echo-test")


def test_a_new_drafter_is_one_registration_away_from_every_front_end(echo_drafter):
    for command in ("generate", "serve", "bench-serve"):
        assert "echo-test" in _flags(_subparser(command))["--drafter"].choices
    drafter = EngineArgs(drafter="echo-test", draft_k=4, ngram_n=3).drafter_options().build()
    assert isinstance(drafter, _Echo) and (drafter.k, drafter.n) == (4, 3)
    with pytest.raises(
        ConfigError, match=r"--ngram-n is an option of the echo-test, ngram, recycling and hybrid drafters"
    ):
        EngineArgs(ngram_n=3).validate()
    with pytest.raises(ConfigError, match=r"--ngram-min-count is an option of the ngram drafter, not of 'echo-test'"):
        EngineArgs(drafter="echo-test", ngram_min_count=2).validate()


# ---------------------------------------------------------------- building


def test_create_engine_builds_the_model_target_and_drafter(tmp_path):
    from tiny_models import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path / "model")
    args = EngineArgs(
        model=str(model_dir),
        backend="native",
        float_kernel="torch",
        drafter="ngram",
        ngram_n=3,
        draft_k=4,
        max_num_seqs=2,
    )
    engine = args.create_engine()
    assert (engine.target.name, engine.target.float_kernel, engine.drafter.name) == ("native", "torch", "ngram")
    assert engine.config.draft_k == 4 and engine.max_num_seqs == 2
    plain = dataclasses.replace(args, drafter="none", ngram_n=None).create_engine(
        model=engine.model, tokenizer=engine.tokenizer, target=engine.target
    )
    assert plain.drafter is None and plain.target is engine.target
    prompt = [1, 5, 6, 7, 5, 6, 7, 5, 6]
    assert engine.generate(prompt, max_new_tokens=8).token_ids == plain.generate(prompt, max_new_tokens=8).token_ids
