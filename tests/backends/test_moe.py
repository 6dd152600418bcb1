"""The mixture-of-experts architectures (``backends/ffn.py``'s ``ExpertsMLP``) against transformers, as
``test_architectures.py`` tests the dense ones: a tiny random-weight model from each config (8 experts,
top 2), the same logits over a 32-token prompt, the same 32 greedy tokens, n-gram and draft-model
speculation token for token plain decoding (float and q8_0 weights), the same tokens alone and among 8
requests, seeded sampling reproducible; and the experts FFN row-invariant: a row's bits alone, among 8
and among 70 rows, the same; on block weights its experts as one C call, the per-op path's bits.
gpt-oss's case sets its sinks and biases to random values (transformers' initialisation leaves the
experts' biases zero and the sinks near it), so every one of them is seen.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_architectures import BASE, NEW, PROMPT, build, check_alone_and_among_eight, check_seeded_sampling

from fastdecode import Engine, build_drafter
from fastdecode.architectures import Experts, Unsupported, decoder_arch
from fastdecode.backends import HFTarget, PagedSequence, make_target, native_support
from fastdecode.backends.ffn import route
from fastdecode.errors import ConfigError
from fastdecode.kernels.cpu import rowgemm_unavailable

_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {  # id -> (model_type, config beyond test_architectures.BASE)
    "qwen3_moe": ("qwen3_moe", dict(_MOE, norm_topk_prob=True)),  # q, k norms per head; renormalised top-k
    # a shared expert behind a sigmoid gate; layer 1 a dense MLP (mlp_only_layers)
    "qwen2_moe": (
        "qwen2_moe",
        dict(_MOE, num_hidden_layers=3, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    # q, k norms over the whole projection; OLMoE's experts are intermediate_size wide
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False)),
    # q, k, v, o biases and a sink per head; sliding (window 8, the prompt crosses it) and full layers; YaRN
    # RoPE; a biased router (top-k logits, softmax over them), biased experts stored interleaved, clamped SwiGLU
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=1.0,  # small enough to clamp on a tiny model's values
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
}


def randomize_gpt_oss(model, seed: int = 5):
    """gpt-oss's sinks and biases (attention's, the router's, the experts') set to random values, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for p in (attn.sinks, attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias):
                p.copy_(torch.randn(p.shape, generator=g))
            for p in (mlp.router.bias, mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias):
                p.copy_(torch.randn(p.shape, generator=g))  # gate and up past swiglu_limit (1.0) at times
    return model


def _build(name: str, seed: int = 0):
    model_type, overrides = CASES[name]
    model = build(model_type, overrides, seed=seed)
    return randomize_gpt_oss(model, seed + 5) if model_type == "gpt_oss" else model


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, _build(request.param)


def _draft_model(name: str):
    return _build(name, seed=7)


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
    kinds = [layer.ffn.kind for layer in target.layers]
    assert kinds == (["experts", "gated", "experts"] if name == "qwen2_moe" else ["experts", "experts"])
    ffn = target.layers[0].ffn
    assert len(ffn.experts) == (4 if name == "mixtral" else 8) and ffn.routing.top_k == 2
    assert (ffn.shared is not None) == (name == "qwen2_moe")
    assert ffn.routing.gating == ("topk_softmax" if name in ("mixtral", "gpt_oss") else "softmax_topk")
    assert ffn.routing.renormalize == (name in ("qwen3_moe", "mixtral", "gpt_oss"))
    if name == "olmoe":
        assert target.layers[0].qk_norm == "proj" and target.layers[0].q_norm.shape == (64,)
    if name == "gpt_oss":
        assert [layer.window for layer in target.layers] == [8, None]
        assert all(layer.sinks.shape == (4,) for layer in target.layers)
        assert ffn.experts[0].clamp == (1.702, 1.0)
    else:
        assert all(layer.sinks is None for layer in target.layers)
    if rowgemm_unavailable() is None:  # every layer in C: an experts layer's attention half ends its run
        calls = target._layer_calls or []
        runs = [(start, stop, [k.ffn_kind for k in stack.layers] if stack else None) for start, stop, stack in calls]
        two = [(0, 1, ["none"]), (1, 2, ["none"])]
        expected = [(0, 1, ["none"]), (1, 3, ["gated", "none"])] if name == "qwen2_moe" else two
        assert runs == expected  # gpt-oss's too: its sinks in fd_layer, its biased, clamped experts in fd_experts
    # the prompt's rows are routed to more than one pair of experts (the test exercises routing)
    h = torch.randn(32, BASE["hidden_size"], generator=torch.Generator().manual_seed(0))
    _, index = route(target._ops.linear(ffn.router, h), ffn.routing)
    assert len(torch.unique(index)) > 2


def test_greedy_tokens_match_transformers_and_speculation_keeps_them(case, tokenizer):
    name, model = case
    ref = Engine(model, tokenizer, target=HFTarget(model)).generate(PROMPT, **NEW)
    plain = Engine(model, tokenizer, target=make_target(model, "native")).generate(PROMPT, **NEW)
    assert len(ref.token_ids) == 32 and plain.token_ids == ref.token_ids
    for drafter in (build_drafter("ngram"), build_drafter("draft-model", model=_draft_model(name), k=3)):
        spec = Engine(model, tokenizer, drafter=drafter, target=make_target(model, "native"))
        assert spec.generate(PROMPT, **NEW).token_ids == ref.token_ids


@pytest.mark.parametrize("weights", ["q8_0", "int8"])
def test_low_bit_weights_speculation_is_plain(case, tokenizer, weights):
    name, model = case
    plain = Engine(model, tokenizer, target=make_target(model, "native", weights)).generate(PROMPT, **NEW)
    for drafter in (build_drafter("ngram"), build_drafter("draft-model", model=_draft_model(name), k=3)):
        spec = Engine(model, tokenizer, drafter=drafter, target=make_target(model, "native", weights))
        assert spec.generate(PROMPT, **NEW).token_ids == plain.token_ids


def test_a_request_gets_the_same_tokens_alone_and_among_eight(case, tokenizer):
    check_alone_and_among_eight(case[1], tokenizer)


def test_seeded_sampling_is_reproducible_and_speculation_keeps_it(case, tokenizer):
    check_seeded_sampling(case[1], tokenizer)


@pytest.mark.parametrize(
    "weights, float_kernel", [("float", "auto"), ("float", "torch"), ("q8_0", "auto"), ("int8", "auto")]
)
def test_the_experts_ffn_is_row_invariant(case, weights, float_kernel):
    """A row's output alone, among 8 rows and among 70 (other rows sharing its experts' calls): the same bits."""
    name, model = case
    target = make_target(model, "native", weights, float_kernel)
    ffn = target.layers[0].ffn
    x = torch.randn(70, BASE["hidden_size"], generator=torch.Generator().manual_seed(1))
    row = 5
    alone = ffn(target._ops, x[row : row + 1].clone())
    among8 = ffn(target._ops, x[:8].clone())
    among70 = ffn(target._ops, x.clone())
    assert torch.equal(alone[0], among8[row]) and torch.equal(alone[0], among70[row])


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss"])
def test_bfloat16_on_torch_s_ops_is_row_invariant_too(name):
    """The torch path (another dtype): the router still in float32, the experts' rows (gpt-oss's biases and
    sinks too) in bfloat16."""
    model = _build(name).to(torch.bfloat16)
    target = make_target(model, "native")
    assert not target.cpu_kernels
    ffn = target.layers[0].ffn
    x = torch.randn(70, BASE["hidden_size"], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone, among70 = ffn(target._ops, x[5:6].clone()), ffn(target._ops, x.clone())
    assert alone.dtype == torch.bfloat16 and torch.equal(alone[0], among70[5])
    hf = HFTarget(model).forward(PROMPT, 32)
    assert (PagedSequence(target).forward(PROMPT, 32) - hf).abs().max() < 0.05  # bfloat16's rounding, routed apart


def test_routing_variants():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 3.0, 0.0, -2.0]])
    w, i = route(logits, Experts(4, 2, "softmax_topk", renormalize=False))
    assert i.tolist() == [[1, 3], [0, 1]]  # a tie goes to the lower expert
    assert torch.allclose(w, torch.softmax(logits, -1).gather(1, i))
    renorm, _ = route(logits, Experts(4, 2, "softmax_topk", renormalize=True))
    topk_softmax, _ = route(logits, Experts(4, 2, "topk_softmax"))
    assert torch.allclose(renorm, topk_softmax) and torch.allclose(renorm.sum(-1), torch.ones(2))


@pytest.mark.parametrize("weights", ["float", "q8_0"])
def test_dense_layers_in_c_among_experts_give_the_per_kernel_bits(weights):
    """Qwen2-MoE with a dense layer between two experts layers: that layer as one C call (fd_layer), the
    others' attention halves in C and their FFNs per kernel; against every layer per kernel, the same bits."""
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    model = build(*CASES["qwen2_moe"])
    mixed, per_call = (PagedSequence(make_target(model, "native", weights)) for _ in range(2))
    assert any(stack is not None for _, _, stack in mixed.executor._layer_calls)
    per_call.executor._layer_calls = None
    for tokens in (PROMPT, [40], [41, 42, 43, 44, 45], [46]):  # a prefill, a step, a verification, a step
        assert torch.equal(mixed.forward(tokens, len(tokens)), per_call.forward(tokens, len(tokens)))


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
def test_the_experts_as_one_c_call_give_the_per_op_bits(case, weights):
    """Block weights: each experts FFN after its router is one C call (``ExpertsMLP.fused``); against the
    per-op path over the same weights, the same logits for a prefill, a step and a verification pass, and
    the same count of experts run (gpt-oss's biased experts and clamped SwiGLU too). Float weights keep the
    per-op path."""
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    name, model = case
    fused, per_op = (PagedSequence(make_target(model, "native", weights)) for _ in range(2))
    experts = [layer.ffn for layer in per_op.executor.layers if layer.ffn.kind == "experts"]
    assert experts and all(ffn.fused is not None for ffn in experts)
    for ffn in experts:
        ffn.fused = None
    per_op.executor._layer_calls = None  # the layer calls hold the experts kernels (fd_layer's FFN_EXPERTS)
    in_c = any(s is not None and s.layers[0].ffn_kind == "experts" for _, _, s in fused.executor._layer_calls)
    assert in_c == all(ffn.shared is None for ffn in experts)  # with a shared expert, the FFN stays in Python
    for tokens in (PROMPT, [40], [41, 42, 43, 44, 45], [46]):
        assert torch.equal(fused.forward(tokens, len(tokens)), per_op.forward(tokens, len(tokens)))
        # the cost model's count: the distinct experts each pass ran, the same on either path
        assert fused.executor.take_experts_run() == per_op.executor.take_experts_run() > 0
    assert make_target(model, "native").layers[0].ffn.fused is None


# -- gpt-oss's own parts, alone: the clamped SwiGLU and the attention sinks


def test_the_clamped_swiglu_is_transformers_and_row_invariant():
    """The C kernel against transformers' GptOssExperts._apply_gate (gate and up interleaved there, side by
    side here), clamping on both sides; a row's bits alone, among 8 and among 70 rows, the same."""
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from fastdecode.backends.layer import KernelOps, TorchOps
    from fastdecode.kernels.cpu import clamped_glu

    model = _build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(70, 2 * 40, generator=torch.Generator().manual_seed(3)) * 3  # [rows, gate 40 | up 40]
    interleaved = torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(1)  # gate, up, gate, up ...
    assert (x.abs() > 1.0).float().mean() > 0.3  # swiglu_limit 1.0: both clamps bite
    expected = GptOssExperts._apply_gate(experts, interleaved)
    got = clamped_glu(x, 1.702, 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(TorchOps(None, 1e-5, False).clamped_glu(x, 1.702, 1.0), expected, rtol=0, atol=0)
    ops = KernelOps(None, 1e-5)
    alone, among8 = ops.clamped_glu(x[5:6].clone(), 1.702, 1.0), ops.clamped_glu(x[:8].clone(), 1.702, 1.0)
    assert torch.equal(alone[0], among8[5]) and torch.equal(alone[0], got[5])


def _eager_sink_attention(q, k, v, positions, scale, window, sinks):
    """transformers' gpt-oss eager attention for query rows at ``positions`` over k, v [KV, L, D]: [n, H * D]."""
    H, KV = q.shape[1], k.shape[0]
    kk, vv = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)  # [H, L, D]
    out = []
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p + 1 - window)
        s = torch.einsum("hd,hld->hl", q[i], kk[:, lo : p + 1]) * scale
        s = torch.cat([s, sinks[:, None]], dim=-1)
        probs = torch.softmax(s - s.max(-1, keepdim=True).values, dim=-1)[:, :-1]
        out.append(torch.einsum("hl,hld->hd", probs, vv[:, lo : p + 1]).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 8])
def test_sink_attention_is_transformers_and_row_invariant(window):
    """attention_rows with sinks: transformers' eager attention; a row's bits alone (a decode step, on the
    phased path past 64 positions), among 8 (a verification) and among 70 (a prefill chunk), the same."""
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    from fastdecode.kernels.cpu import attention_rows

    g = torch.Generator().manual_seed(4)
    H, KV, D, start, row = 4, 2, 16, 60, 5
    q = torch.randn(70, H, D, generator=g)
    k, v = torch.randn(KV, start + 70, D, generator=g), torch.randn(KV, start + 70, D, generator=g)
    sinks = torch.tensor([3.0, -1.0, 0.5, 8.0])  # head 3's sink outweighs its scores
    among70 = attention_rows(q, k, v, start, 0.25, window, sinks=sinks)
    among8 = attention_rows(q[:8].clone(), k, v, start, 0.25, window, sinks=sinks)
    alone = attention_rows(q[row : row + 1].clone(), k, v, start + row, 0.25, window, sinks=sinks)
    assert torch.equal(alone[0], among8[row]) and torch.equal(alone[0], among70[row])
    expected = _eager_sink_attention(q, k, v, range(start, start + 70), 0.25, window, sinks)
    torch.testing.assert_close(among70, expected, rtol=1e-5, atol=1e-5)
    plain = attention_rows(q, k, v, start, 0.25, window)
    assert not torch.allclose(plain, among70)  # the sinks take their share
    with pytest.raises(ValueError, match="sinks must be"):
        attention_rows(q, k, v, start, 0.25, window, sinks=sinks[:2])


@pytest.mark.parametrize("kv", ["float16", "q8_0", "q4_0"])
def test_gpt_oss_over_a_quantized_kv_cache_speculates_as_it_decodes(tokenizer, kv):
    """The sinks over every cache row format: n-gram and draft-model speculation token for token plain decoding."""
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    overrides = dict(CASES["gpt_oss"][1], head_dim=32)  # quantized rows hold blocks of 32
    model, draft = (randomize_gpt_oss(build("gpt_oss", overrides, seed=seed), seed + 5) for seed in (0, 7))
    plain = Engine(model, tokenizer, target=make_target(model, "native", kv_cache_dtype=kv)).generate(PROMPT, **NEW)
    for drafter in (build_drafter("ngram"), build_drafter("draft-model", model=draft, k=3)):
        spec = Engine(model, tokenizer, drafter=drafter, target=make_target(model, "native", kv_cache_dtype=kv))
        assert spec.generate(PROMPT, **NEW).token_ids == plain.token_ids


# -- what the native decoder refuses: one clear error, naming what is missing and --backend hf


def test_an_unknown_gating_is_refused():
    with pytest.raises(Unsupported, match="gating 'sigmoid_topk'"):
        Experts(8, 2, "sigmoid_topk")
    with pytest.raises(Unsupported, match="top 9 of 8"):
        Experts(8, 9)


def test_olmoe_clip_qkv_is_refused():
    model = build("olmoe", dict(_MOE, clip_qkv=8.0))
    with pytest.raises(ConfigError, match="clip_qkv") as info:
        make_target(model, "native")
    assert "--backend hf" in str(info.value) and make_target(model, "auto").name == "hf"


def test_an_expert_tensor_of_the_wrong_shape_is_refused():
    model = build("qwen3_moe", dict(_MOE))
    experts = model.model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[:, :, :16].contiguous())
    with pytest.raises(ConfigError, match="experts of shape") as info:
        make_target(model, "native")
    assert "--backend hf" in str(info.value)


def test_an_experts_description_without_routing_is_refused():
    model = build("qwen3_moe", dict(_MOE))
    arch = dataclasses.replace(decoder_arch(model), experts=None)
    from fastdecode.backends.ffn import FFN_KINDS
    from fastdecode.backends.native_weights import NativeLinears

    with pytest.raises(Unsupported, match="without its routing"):
        FFN_KINDS["experts"](model.model.layers[0], arch, NativeLinears(model))
