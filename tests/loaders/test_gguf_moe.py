"""The mixture-of-experts architectures written to GGUF (the project's exporter: 3-D ffn_*_exps tensors,
the router ffn_gate_inp, Qwen2-MoE's ffn_*_shexp and ffn_gate_inp_shexp) and read back by the file-size
loader, as ``test_gguf_architectures.py`` does for the dense ones: transformers' logits, transformers'
greedy tokens and speculation token-identical to plain decoding, each expert's blocks taken from its
rows of the file; the config from the metadata (transformers' tables, and ours where they stop short);
a file whose experts disagree with its metadata refused by name."""

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
}
IDS = [1, 50, 700, 9000, 33, 48000, 5, 17, 4242, 12, 300, 7, 9, 11, 2048, 99]


def _model(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    config = AutoConfig.for_model(model_type, **{**SMALL, **CASES[model_type], **overrides})
    return AutoModelForCausalLM.from_config(config).float().eval()


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


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_q8_0_file_speculates_as_it_decodes(model_type, tmp_path):
    path = export_gguf(_model(model_type), tmp_path / "m.gguf", TOKENIZER, "q8_0")
    lazy, tokenizer = load_model(str(path), lazy=True)
    assert make_target(lazy, "native", "gguf").weights == "gguf:q8_0"  # the routers stay float32, outside
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(IDS, max_new_tokens=16, min_tokens=16).token_ids == tokens


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
