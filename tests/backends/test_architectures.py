"""Every architecture of the native decoder's registry (``fastdecode.architectures``) against transformers,
on a tiny random-weight model built from its own config (transformers' initialisation): the same
logits over a 32-token prompt, the same 32 greedy tokens, n-gram speculation token for token plain
decoding, the same tokens alone and among 8 requests, and seeded sampling reproducible.

An architecture is one line of :data:`CASES`: its ``model_type`` and what its config sets beyond
:data:`BASE` (what makes the case exercise the architecture's own parts).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fastdecode import Engine, build_drafter
from fastdecode.architectures import (
    ARCHITECTURES,
    NOPE,
    architectures_markdown,
    gguf_tensor_name,
    supported_architectures,
)
from fastdecode.backends import HFTarget, PagedSequence, make_target, native_support
from fastdecode.errors import ConfigError
from fastdecode.kernels.cpu import rowgemm_unavailable

BASE = dict(
    vocab_size=96,  # the CharTokenizer fixture's
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_LONGROPE = dict(  # Phi-3.5's RoPE: short factors up to the original length (96 here), long ones past it
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0 + 0.05 * i for i in range(8)],
    long_factor=[2.0 + 0.1 * i for i in range(8)],
)
CASES = {  # id -> (model_type, config beyond BASE)
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),  # q and k norms per head
    "olmo2": ("olmo2", {}),  # norms after the branches only, q and k norms over the whole projection
    "olmo3": ("olmo3", dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "exaone4": (  # post norms, q and k norms per head; local layers with RoPE and a window, global ones NoPE
        "exaone4",
        dict(
            num_hidden_layers=3,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
        ),
    ),
    "granite": (
        "granite",
        dict(embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.3, logits_scaling=4.0),
    ),
    "smollm3": ("smollm3", dict(num_hidden_layers=4)),  # NoPE in layer 3
    "phi3": ("phi3", dict(sliding_window=12)),  # fused qkv and gate_up, a window the prompt crosses
    "gemma2": (  # sandwich norms, soft caps small enough to bite on a tiny model, local and global layers
        "gemma2",
        dict(
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=0.05,
            final_logit_softcapping=0.3,
            query_pre_attn_scalar=16,
        ),
    ),
    "phi3-longrope": (
        "phi3",
        dict(rope_parameters=_LONGROPE, original_max_position_embeddings=96, max_position_embeddings=192),
    ),
}
PROMPT = [1] + [10, 11, 12, 13, 14, 15, 16, 17] * 3 + [20, 21, 22, 23, 24, 25, 26]  # 32 tokens
NEW = dict(max_new_tokens=32, min_tokens=32)  # EOS masked: 32 tokens every time


def build(model_type: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    return AutoModelForCausalLM.from_config(config).float().eval()


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    model_type, overrides = CASES[request.param]
    return request.param, build(model_type, overrides)


def test_every_registered_architecture_has_a_case():
    elsewhere = {"mistral", "qwen2", "gemma3_text"}  # tests/backends/test_native.py, test_native_gemma3.py
    elsewhere |= {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"}  # the mixtures of experts: test_moe.py
    assert {model_type for model_type, _ in CASES.values()} | elsewhere == set(ARCHITECTURES)


@pytest.mark.parametrize("float_kernel", ["auto", "torch"])
def test_logits_match_transformers(case, float_kernel):
    name, model = case
    assert native_support(model) is None
    native, hf = PagedSequence(make_target(model, "native", "float", float_kernel)), HFTarget(model)
    assert (native.forward(PROMPT, 32) - hf.forward(PROMPT, 32)).abs().max() < 1e-4
    for tokens in ([40, 41, 42, 43], [44]):  # a verification pass, a decode step
        assert (native.forward(tokens, len(tokens)) - hf.forward(tokens, len(tokens))).abs().max() < 1e-4


def test_the_description_reaches_the_layers(case):
    name, model = case
    target = make_target(model, "native")
    layers = target.layers
    if name == "smollm3":
        assert [layer.rope for layer in layers] == [None, None, None, NOPE]
    if name == "olmo2":
        assert layers[0].attn_norm is None and layers[0].mlp_norm is None and layers[0].qk_norm == "proj"
        assert layers[0].q_norm.shape == (64,) and layers[0].k_norm.shape == (32,)
    if name == "phi3":
        assert [layer.window for layer in layers] == [12, 12]
    if name == "phi3-longrope":  # the context stops where the short factors do, and says so
        assert target.context_length == 96 and "96 of this model's 192 positions" in target.kernel_note
    if name == "exaone4":
        assert [layer.rope for layer in layers] == [None, NOPE, NOPE] and [layer.window for layer in layers] == [
            6,
            None,
            None,
        ]
    if name == "gemma2":
        assert [layer.softcap for layer in layers] == [0.05, 0.05] and [layer.window for layer in layers] == [6, None]
    if name == "granite":
        assert layers[0].residual_scale == 0.3 and target.arch.logit_divisor == 4.0
    if rowgemm_unavailable() is None:
        assert target._layer_calls is not None  # decode and verify: one kernel call a layer


def test_greedy_tokens_match_transformers_with_and_without_ngram(case, tokenizer):
    name, model = case
    ref = Engine(model, tokenizer, target=HFTarget(model)).generate(PROMPT, **NEW)
    plain = Engine(model, tokenizer, target=make_target(model, "native")).generate(PROMPT, **NEW)
    spec = Engine(model, tokenizer, drafter=build_drafter("ngram"), target=make_target(model, "native"))
    assert len(ref.token_ids) == 32
    assert plain.token_ids == ref.token_ids
    assert spec.generate(PROMPT, **NEW).token_ids == ref.token_ids


def check_alone_and_among_eight(model, tokenizer) -> None:
    """A request's tokens alone and as the fourth of eight (test_moe.py's experts too)."""
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram"), target=make_target(model, "native"))
    alone = engine.generate(PROMPT, **NEW).token_ids
    others = [[1] + [30 + i, 31 + i, 32 + i] * (2 + i) for i in range(7)]
    batch = engine.generate([others[0], others[1], others[2], PROMPT, *others[3:]], **NEW)
    assert batch[3].token_ids == alone


def test_a_request_gets_the_same_tokens_alone_and_among_eight(case, tokenizer):
    check_alone_and_among_eight(case[1], tokenizer)


def check_seeded_sampling(model, tokenizer) -> None:
    """Seeded sampling reproducible, and the same tokens under n-gram speculation (test_moe.py's too)."""
    plain = Engine(model, tokenizer, target=make_target(model, "native"))
    spec = Engine(model, tokenizer, drafter=build_drafter("ngram"), target=make_target(model, "native"))
    options = dict(NEW, temperature=0.8, seed=5)
    first = plain.generate(PROMPT, **options).token_ids
    assert plain.generate(PROMPT, **options).token_ids == first
    assert spec.generate(PROMPT, **options).token_ids == first


def test_seeded_sampling_is_reproducible_and_speculation_keeps_it(case, tokenizer):
    check_seeded_sampling(case[1], tokenizer)


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_one_call_layers_give_the_per_kernel_bits(case, weights):
    """fd_layer (C) and the layer's steps in Python over the same kernels: the same bits."""
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    name, model = case
    fused, per_call = (PagedSequence(make_target(model, "native", weights)) for _ in range(2))
    assert fused.executor._layer_calls is not None
    per_call.executor._layer_calls = None  # the same kernels, called one by one from Python
    for tokens in (PROMPT, [40], [41, 42, 43, 44, 45], [46]):  # a prefill, a step, a verification, a step
        assert torch.equal(fused.forward(tokens, len(tokens)), per_call.forward(tokens, len(tokens)))


# -- what the native decoder refuses: one clear error, naming what is missing and --backend hf


def _refusal(model) -> str:
    with pytest.raises(ConfigError) as info:
        make_target(model, "native")
    assert "--backend hf" in str(info.value) and make_target(model, "auto").name == "hf"
    return str(info.value)


@pytest.mark.parametrize(
    "model_type, overrides, missing",
    [
        ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
        ("qwen3", dict(hidden_act="relu"), "activation 'relu'"),
        ("olmo2", dict(hidden_act="gelu"), "activation 'gelu'"),
        ("phi3", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (
            "smollm3",
            dict(use_sliding_window=True, sliding_window=8, layer_types=["chunked_attention"] * 2),
            "layer types",
        ),
        ("gpt2", dict(n_embd=64, n_layer=2, n_head=4), "architecture 'gpt2' has no native decoder"),
    ],
)
def test_what_it_does_not_describe_is_refused_clearly(model_type, overrides, missing):
    model = build(model_type, overrides)
    assert missing in _refusal(model)


def test_the_architecture_table_lists_the_registry():
    rows = supported_architectures()
    assert [r.model_type for r in rows] == list(ARCHITECTURES)
    assert all(r.native and r.speculation for r in rows)
    table = architectures_markdown()
    assert all(f"| `{r.model_type}` |" in table for r in rows)


def test_the_readme_table_is_the_registry_s():
    """The README's table of architectures (once it has one, between these markers) is the registry's."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    begin, end = "<!-- architectures -->", "<!-- /architectures -->"
    if begin not in readme:
        pytest.skip("README.md has no architecture table yet")
    assert readme.split(begin, 1)[1].split(end, 1)[0].strip() == architectures_markdown()


def test_gguf_names_come_from_gguf_py():
    assert gguf_tensor_name("phi3", "model.layers.0.self_attn.qkv_proj", 2) == "blk.0.attn_qkv"
    assert gguf_tensor_name("olmo2", "model.layers.1.post_feedforward_layernorm", 2) == "blk.1.post_ffw_norm"
    assert gguf_tensor_name("llama", "model.layers.1.post_attention_layernorm", 2) == "blk.1.ffn_norm"
    assert gguf_tensor_name("qwen3", "lm_head", 2) == "output"
    assert gguf_tensor_name("gpt2", "lm_head", 2) is None
    for entry in ARCHITECTURES.values():  # every llama.cpp name is one gguf-py knows
        o = gguf_tensor_name(entry.model_type, "model.layers.1.self_attn.o_proj", 2)
        assert entry.gguf_arch is None or o == "blk.1.attn_output", entry.model_type
