"""A mixture of experts' layers on the C path (``backends/layer.py``'s ``layer_kernel``): an experts layer
whose experts are blocks and which has no shared expert is one C call, router, top-k and experts included
(``fd_layer`` with an FFN of kind ``experts``); otherwise its attention half is one C call (kind ``none``)
and its FFN (the experts one C call where their weights are blocks) and its residual add run in Python. Against the
per-op path over the same weights: the same logits, bit for bit, over a prefill, a decode step and a
verification pass of k + 1 rows, the same keys and values, in float32, q8_0, q4_0 and a GGUF file's
blocks (a Q4_K_M mix, an OLMoE file, gpt-oss's MXFP4 experts); a row's bits alone, among 8 and among 70
rows the same; n-gram speculation token for token plain decoding. gpt-oss's layers too: q, k, v, o biases,
a sink per head and a sliding window in fd_layer, its biased experts and clamped SwiGLU in fd_experts. A
layer with a part fd_layer does not express keeps the per-op path, decided from the layer's description."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_architectures import PROMPT
from test_moe import CASES, _build

import fastdecode
from fastdecode.backends import PagedSequence, make_target
from fastdecode.backends.layer import DecoderLayer, layer_kernel
from fastdecode.kernels.cpu import rowgemm_unavailable
from fastdecode.kv.cache import BatchEntry

pytestmark = pytest.mark.skipif(rowgemm_unavailable() is not None, reason=str(rowgemm_unavailable()))

PASSES = (PROMPT, [40], [41, 42, 43, 44, 45], [46])  # a prefill, a step, a verification (k = 4), a step


# gpt-oss's case with random sinks and biases (test_moe's _build)
@pytest.fixture(scope="module", params=list(CASES))
def model(request):
    return _build(request.param)


def test_gpt_oss_s_layers_are_c_calls():
    """Every gpt-oss layer one fd_layer call holding its sinks and window, its router (with its bias) and
    its experts (fd_experts on block weights: biases and clamp held by the experts kernel)."""
    target = make_target(_build("gpt_oss"), "native", "q8_0")
    kernels = [layer_kernel(layer) for layer in target.layers]
    assert all(k is not None and k.ffn_kind == "experts" for k in kernels)
    assert all(
        k.moe.experts is layer.ffn.fused and k.moe.router.bias is not None for k, layer in zip(kernels, target.layers)
    )
    assert [k._desc.window for k in kernels] == [8, 0]
    assert all(k._desc.sinks == layer.sinks.data_ptr() for k, layer in zip(kernels, target.layers))
    assert all(layer.ffn.fused is not None and layer.ffn.fused._desc.act == 2 for layer in target.layers)
    assert target.layers[0].ffn.fused._desc.limit == 1.0


def _check_c_path_is_per_op(c_path: PagedSequence, per_op: PagedSequence, passes=PASSES) -> None:
    """Every experts layer in C on ``c_path`` (whole where its experts are one C call and it has no shared
    expert, else its attention half), every layer per op on ``per_op``: the same logits and counts of
    experts run for each pass, the same cache."""
    executor = c_path.executor
    kinds = [k.ffn_kind for _, _, stack in executor._layer_calls for k in stack.layers]  # every layer in C
    assert kinds == [_c_kind(layer) for layer in executor.layers]
    per_op.executor._layer_calls = None
    for tokens in passes:
        assert torch.equal(c_path.forward(tokens, len(tokens)), per_op.forward(tokens, len(tokens)))
        assert executor.take_experts_run() == per_op.executor.take_experts_run() > 0
    t = torch.arange(c_path.cache_len)
    for a, b in zip(c_path._cache.k + c_path._cache.v, per_op._cache.k + per_op._cache.v):
        B = a.shape[2]
        assert torch.equal(
            a[torch.tensor(c_path._table)[t // B], :, t % B], b[torch.tensor(per_op._table)[t // B], :, t % B]
        )


def _c_kind(layer) -> str:
    if layer.ffn.kind != "experts":
        return "gated"
    return "experts" if layer.ffn.fused is not None and layer.ffn.shared is None else "none"


@pytest.mark.parametrize("weights", ["float", "q8_0", "q4_0"])
def test_the_attention_half_in_c_gives_the_per_op_bits(model, weights):
    c_path, per_op = (PagedSequence(make_target(model, "native", weights)) for _ in range(2))
    _check_c_path_is_per_op(c_path, per_op)


@pytest.mark.parametrize("weights", ["float", "q8_0"])
def test_a_row_gets_its_bits_alone_among_8_and_among_70(model, weights):
    target = make_target(model, "native", weights)
    cache = target.new_kv_cache(16, 16)
    target.forward_batch(cache, [BatchEntry(PROMPT[:20], 0, [0, 1], 1)])
    step = BatchEntry([40], 20, [0, 1], 1)
    alone = target.forward_batch(cache, [step])
    among8 = target.forward_batch(cache, [step, BatchEntry([(5 + i) % 90 for i in range(7)], 0, [2], 1)])
    among70 = target.forward_batch(cache, [step, BatchEntry([(3 + i) % 90 for i in range(69)], 0, [3, 4, 5, 6, 7], 2)])
    assert torch.equal(alone[0], among8[0]) and torch.equal(alone[0], among70[0])


def test_n_gram_speculation_on_the_c_path_is_plain_decoding(model, tokenizer):
    engine = lambda drafter: fastdecode.Engine(  # noqa: E731
        model, tokenizer, drafter=drafter, target=make_target(model, "native", "q4_0")
    )
    plain = engine(None).generate(PROMPT, max_new_tokens=32, min_tokens=32).token_ids
    assert (
        engine(fastdecode.build_drafter("ngram")).generate(PROMPT, max_new_tokens=32, min_tokens=32).token_ids == plain
    )


def test_a_part_fd_layer_does_not_express_keeps_the_per_op_path(model):
    """The choice reads the layer's description: a field beyond fd_layer_desc's, set, keeps it per op."""
    target = make_target(model, "native", "q8_0")
    layer = target.layers[0]
    assert layer_kernel(layer).ffn_kind == _c_kind(layer)

    @dataclasses.dataclass
    class WithMore(DecoderLayer):
        extra: torch.Tensor | None = None  # a part fd_layer_desc lacks

    fields = {f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)}
    assert layer_kernel(WithMore(**fields)) is not None  # unset: fd_layer runs it
    assert layer_kernel(WithMore(**fields, extra=torch.zeros(layer.n_heads))) is None
    assert layer_kernel(dataclasses.replace(layer, sinks=torch.zeros(layer.n_heads))) is not None  # gpt-oss's
    assert layer_kernel(dataclasses.replace(layer, qkv=lambda x: x)) is None  # a projection not on a C GEMM


# -- GGUF files: the project's exporter and the benchmark's synthetic files (their tokenizer copied in)


@pytest.mark.integration
def test_a_q4_k_m_mix_file_on_the_c_path(tmp_path):
    """Qwen3-MoE's layout in llama.cpp's Q4_K_M mix (Q6_K attn_v and ffn_down_exps on some layers)."""
    from fastdecode.bench.synthetic_gguf import synthetic_gguf
    from fastdecode.loading import load_model

    lazy, tokenizer = load_model(str(synthetic_gguf("tiny-qwen3-moe", "q4_k_m", tmp_path)), lazy=True)
    c_path, per_op = (PagedSequence(make_target(lazy, "native", "gguf")) for _ in range(2))
    assert all(layer.ffn.fused is not None for layer in c_path.executor.layers)
    ids = [1, 50, 700, 9000, 33, 48000, 5, 17, 4242, 12, 300, 7, 9, 11, 2048, 99]
    _check_c_path_is_per_op(c_path, per_op, (ids, [40], [41, 42, 43, 44, 45], [46]))
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(ids, max_new_tokens=12, min_tokens=12).token_ids
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(ids, max_new_tokens=12, min_tokens=12).token_ids == tokens


@pytest.mark.integration
def test_an_olmoe_file_on_the_c_path(tmp_path):
    """OLMoE (q and k norms over the whole projection) exported in Q4_0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastdecode.formats.gguf_export import export_gguf
    from fastdecode.loading import BUILTIN_MODELS, load_model

    torch.manual_seed(3)
    config = AutoConfig.for_model(
        "olmoe",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=256,
        num_experts=8,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config).float().eval()
    path = export_gguf(model, tmp_path / "m.gguf", BUILTIN_MODELS["smollm2-135m"].locate(), "q4_0")
    lazy, _ = load_model(str(path), lazy=True)
    c_path, per_op = (PagedSequence(make_target(lazy, "native", "gguf")) for _ in range(2))
    assert c_path.executor.layers[0].qk_norm == "proj"
    _check_c_path_is_per_op(c_path, per_op, ([1, 50, 700, 9000, 33, 48000, 5, 17], [40], [41, 42, 43, 44, 45]))


@pytest.mark.integration
def test_a_tiny_gpt_oss_mxfp4_file_on_the_c_path(tmp_path):
    """The benchmark's tiny gpt-oss (``make-gguf --shape tiny-gpt-oss --type mxfp4``: MXFP4 experts, float32
    biases and sinks, a window of 128 on alternate layers, YaRN): every layer's attention half and experts
    in C, the per-op path's logits and cache bit for bit over a prefill past the window, a step and a
    verification; a row's bits alone and among 8 requests the same; greedy tokens the per-op path's, and
    n-gram speculation's plain decoding's."""
    from fastdecode.bench.synthetic_gguf import synthetic_gguf
    from fastdecode.loading import load_model

    lazy, tokenizer = load_model(str(synthetic_gguf("tiny-gpt-oss", "mxfp4", tmp_path)), lazy=True)
    c_path, per_op = (PagedSequence(make_target(lazy, "native", "gguf")) for _ in range(2))
    layers = c_path.executor.layers
    assert [layer.window for layer in layers] == [128, None] * 2 and all(
        layer.ffn.fused is not None for layer in layers
    )
    for layer in per_op.executor.layers:
        layer.ffn.fused = None
    ids = [(7 + 37 * i) % 1000 + 1 for i in range(140)]  # past the sliding layers' window
    _check_c_path_is_per_op(c_path, per_op, (ids, [40], [41, 42, 43, 44, 45], [46]))

    target = c_path.executor
    cache = target.new_kv_cache(32, 16)
    target.forward_batch(cache, [BatchEntry(ids[:20], 0, [0, 1], 1)])
    step = BatchEntry([40], 20, [0, 1], 1)
    alone = target.forward_batch(cache, [step])
    others = [BatchEntry([(5 + 3 * i + j) % 900 for j in range(1 + i)], 0, [2 + i], 1) for i in range(7)]
    among8 = target.forward_batch(cache, [*others[:3], step, *others[3:]])
    assert torch.equal(alone[0], among8[3])

    prompt = "Hello there, how are"
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(prompt, max_new_tokens=16, min_tokens=16).token_ids
    assert (
        fastdecode.Engine(lazy, tokenizer, target=per_op.executor)
        .generate(prompt, max_new_tokens=16, min_tokens=16)
        .token_ids
        == tokens
    )
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(prompt, max_new_tokens=16, min_tokens=16).token_ids == tokens
