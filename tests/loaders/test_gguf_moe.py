"""The mixture-of-experts architectures written to GGUF (the project's exporter: 3-D ffn_*_exps tensors,
the router ffn_gate_inp, Qwen2-MoE's ffn_*_shexp and ffn_gate_inp_shexp) and read back by the file-size
loader, as ``test_gguf_architectures.py`` does for the dense ones: transformers' logits, transformers'
greedy tokens and speculation token-identical to plain decoding, each expert's blocks taken from its
rows of the file; the config from the metadata (transformers' tables, and ours where they stop short);
a file whose experts disagree with its metadata refused by name. gpt-oss: its sinks (``attn_sinks``), the
router's bias, the experts' biases (``ffn_*_exps.bias``), its window and YaRN RoPE through the metadata
(ours where transformers' table stops short), the experts in MXFP4 speculating as they decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fastdecode
from fastdecode.backends import PagedSequence, make_target
from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.formats import gguf_export
from fastdecode.formats.gguf_export import export_gguf
from fastdecode.loaders.gguf_model import EXPERTS_ATTR, is_lazy
from fastdecode.loading import BUILTIN_MODELS, load_model

pytestmark = pytest.mark.integration  # the embedded model's tokenizer is copied into each file

TOKENIZER = BUILTIN_MODELS["smollm2-135m"].locate()
SMALL = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {  # model_type -> its config beyond SMALL (what llama.cpp's file can say of it)
    "qwen3_moe": dict(_MOE, norm_topk_prob=True, head_dim=16),
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        head_dim=16,
        sliding_window=8,  # IDS cross it
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
}
_MXFP4_EXPERTS = {"ffn_gate_exps": "mxfp4", "ffn_up_exps": "mxfp4", "ffn_down_exps": "mxfp4"}  # gpt-oss's release
IDS = [1, 50, 700, 9000, 33, 48000, 5, 17, 4242, 12, 300, 7, 9, 11, 2048, 99]


def _model(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    config = AutoConfig.for_model(model_type, **{**SMALL, **CASES[model_type], **overrides})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if model_type == "gpt_oss":  # transformers' initialisation leaves the experts' biases zero, the sinks near it
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("sinks", "bias")):
                    p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    model = _model(request.param)
    path = export_gguf(model, tmp_path_factory.mktemp(request.param) / "m.gguf", TOKENIZER, "f32")
    return model, path


def test_the_architectures_the_table_says_load_have_a_config_mapping():
    from fastdecode.architectures.table import GGUF_OWN_CONFIGS
    from fastdecode.loaders.gguf_config import _OWN_KEYS

    assert set(GGUF_OWN_CONFIGS) <= set(_OWN_KEYS)


def test_the_config_is_the_model_s(exported):
    model, path = exported
    lazy, _ = load_model(str(path), lazy=True)
    assert lazy.config.model_type == model.config.model_type
    for key in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(lazy.config, key, None) == getattr(model.config, key, None), key
    assert lazy.config.intermediate_size == model.config.intermediate_size
    if model.config.model_type == "qwen2_moe":
        assert lazy.config.shared_expert_intermediate_size == 48
    experts = lazy.model.layers[0].mlp.experts
    gate, up, down = getattr(experts, EXPERTS_ATTR)  # per expert, where its rows lie
    assert len(gate) == len(up) == len(down) == experts.gate_up_proj.shape[0]
    if model.config.model_type == "gpt_oss":  # gate_up_proj [E, hidden, 2 I]; sliding layers, YaRN, biases
        assert gate[1].shape == (32, 64) and down[1].shape == (64, 32) and lazy.config.head_dim == 16
        assert lazy.config.sliding_window == 8 and lazy.config.layer_types == model.config.layer_types
        assert lazy.config.rope_parameters == model.config.rope_parameters
        assert torch.equal(experts.gate_up_proj_bias, model.model.layers[0].mlp.experts.gate_up_proj_bias)
        return
    assert gate[1].shape == (experts.gate_up_proj.shape[1] // 2, 64) and down[1].shape == (64, gate[1].shape[0])


def test_native_from_the_file_is_transformers(exported):
    model, path = exported
    lazy, tokenizer = load_model(str(path), lazy=True)
    target = make_target(lazy, "native", "gguf")
    assert is_lazy(lazy)  # the experts came from the file: no float model was built
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0]
    got = PagedSequence(target).forward(IDS, len(IDS))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids
    # each token transformers' greedy choice, from one forward over the whole sequence (its incremental
    # decoding routes a step's rows from values ~1e-7 off the full pass's: at a near-tie of two experts'
    # router weights, as in OLMoE's case here, it takes the other expert - a reference of its own)
    with torch.no_grad():
        whole = model(torch.tensor([IDS + tokens])).logits[0, len(IDS) - 1 : -1]
    assert whole.argmax(-1).tolist() == tokens
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids == tokens


def test_the_materialized_file_is_the_model(exported):
    model, path = exported
    full, _ = load_model(str(path), lazy=False)  # the float model, dequantized tensor by tensor
    for name, param in model.named_parameters():
        assert torch.equal(full.get_parameter(name), param), name


@pytest.mark.parametrize(
    "model_type, weight_type, experts_type, weights",
    [
        ("qwen3_moe", "q8_0", None, "gguf:q8_0"),
        ("mixtral", "q8_0", None, "gguf:q8_0"),
        ("olmoe", "q4_0", "mxfp4", "gguf:mxfp4+q4_0"),  # gpt-oss's experts' type beside Q4_0 layers
        ("gpt_oss", "q8_0", None, "gguf:q8_0"),  # biased, clamped experts: one C call too
    ],
)
def test_a_block_file_speculates_as_it_decodes(model_type, weight_type, experts_type, weights, tmp_path):
    """The experts of a block file run as one C call each layer (``ExpertsMLP.fused``): greedy tokens the
    per-op path's, and n-gram speculation token for token plain decoding."""
    kinds = {} if experts_type is None else {f"ffn_{p}_exps": experts_type for p in ("gate", "up", "down")}
    path = export_gguf(_model(model_type), tmp_path / "m.gguf", TOKENIZER, weight_type, kinds)
    lazy, tokenizer = load_model(str(path), lazy=True)
    target = make_target(lazy, "native", "gguf")
    assert target.weights == weights  # the routers stay float32, outside
    assert all(layer.ffn.fused is not None for layer in target.layers)  # gpt-oss's biased, clamped experts too
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids == tokens
    for layer in target.layers:
        layer.ffn.fused = None
    target._layer_calls = None  # they hold the experts kernels (fd_layer's FFN_EXPERTS): every layer per op
    per_op = fastdecode.Engine(lazy, tokenizer, target=target)
    assert per_op.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids == tokens


def test_gpt_oss_with_mxfp4_experts_speculates_as_it_decodes(tmp_path):
    """gpt-oss as released: the experts in MXFP4 (ggml type 39), the rest float; each expert's blocks from its
    rows of the file; every layer one fd_layer call, router and experts (fd_experts) included, the
    per-op path's logits bit for bit; n-gram and draft-model speculation token for token plain decoding."""
    model = _model("gpt_oss")
    path = export_gguf(model, tmp_path / "m.gguf", TOKENIZER, "f32", _MXFP4_EXPERTS)
    lazy, tokenizer = load_model(str(path), lazy=True)
    target = make_target(lazy, "native", "gguf")
    assert target.weights == "gguf:mxfp4+f32" and is_lazy(lazy)
    assert [k.ffn_kind for _, _, stack in target._layer_calls for k in stack.layers] == ["experts"] * len(target.layers)
    assert all(layer.ffn.fused is not None for layer in target.layers)
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0]
    fused = PagedSequence(target).forward(IDS, len(IDS))
    assert (fused - expected).abs().max() < 0.05  # MXFP4's rounding
    per_op = make_target(lazy, "native", "gguf")
    per_op._layer_calls = None
    for layer in per_op.layers:
        layer.ffn.fused = None
    assert torch.equal(fused, PagedSequence(per_op).forward(IDS, len(IDS)))
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids
    draft, _ = load_model(str(path), lazy=False)  # the file's float model drafts
    for drafter, options in (("ngram", {}), ("draft-model", dict(model=draft, k=3))):
        spec = fastdecode.accelerate(lazy, tokenizer, drafter=drafter, weights="gguf", **options)
        assert spec.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids == tokens


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("expert_intermediate_size", 16, r"expert tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[8, 32, 64\]"),
        ("num_experts", 6, r"tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \[8, 64\]"),
    ],
)
def test_experts_that_disagree_with_the_metadata_are_refused(tmp_path, monkeypatch, field, value, message):
    real = gguf_export.shape_of
    monkeypatch.setattr(gguf_export, "shape_of", lambda config: dataclasses.replace(real(config), **{field: value}))
    path = export_gguf(_model("qwen3_moe"), tmp_path / "m.gguf", TOKENIZER, "f32")
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path), lazy=True)


def test_what_a_gguf_cannot_say_is_not_written(tmp_path):
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        export_gguf(_model("qwen3_moe", norm_topk_prob=False), tmp_path / "m.gguf", TOKENIZER, "f32")
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        export_gguf(_model("qwen2_moe", mlp_only_layers=[1]), tmp_path / "m.gguf", TOKENIZER, "f32")
    with pytest.raises(ConfigError, match="swiglu_limit 7.0"):  # llama.cpp's graph fixes the clamp
        export_gguf(_model("gpt_oss", swiglu_limit=1.0), tmp_path / "m.gguf", TOKENIZER, "f32")
    with pytest.raises(ConfigError, match="layer_types"):
        export_gguf(_model("gpt_oss", layer_types=["full_attention"] * 2), tmp_path / "m.gguf", TOKENIZER, "f32")
