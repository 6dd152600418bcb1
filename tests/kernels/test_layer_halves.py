"""A decoder layer's attention half in one C call (``fd_layer`` with an FFN of kind ``none``: a
:class:`DecoderLayerKernel` without gate_up and down), the FFN left to the caller: the half's call
then the FFN's kernels one by one give the whole layer's bits (``fd_layer`` with its gated MLP), the
keys and values written alike; a row's bits alone, among 8 and among 70 rows the same; a layer that
leaves its FFN to the caller only last in a stack; half an FFN refused."""

from __future__ import annotations

import pytest
import torch

from fastdecode.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.rowgemm_unavailable() is not None, reason=str(cpu.rowgemm_unavailable()))

H, KV, D, HIDDEN, INTER, EPS = 4, 2, 16, 64, 96, 1e-6
CAPACITY = 80  # positions of the contiguous cache
# (id, block weights, qk_norm, norms): Llama's pre norms; OLMoE's q, k norms over the projection;
# OLMo 2's post norms only (the FFN's input is the residual stream itself); Gemma's four and a soft cap
VARIANTS = [
    ("llama-f32", None, None, ("attn_norm", "mlp_norm")),
    ("olmoe-q8_0", "q8_0", "proj", ("attn_norm", "mlp_norm")),
    ("qwen3-q4_0", "q4_0", "head", ("attn_norm", "mlp_norm")),
    ("olmo2-f32", None, "proj", ("post_attn_norm", "post_mlp_norm")),
    ("gemma-q8_0", "q8_0", "head", ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm")),
]


def _weights(fmt: str | None, seed: int = 0) -> dict:
    from fastdecode.kernels.gguf_blocks import BlockTensor
    from fastdecode.kernels.quant import Projection, pack

    gen = torch.Generator().manual_seed(seed)
    shapes = {"qkv": ((H + 2 * KV) * D, HIDDEN), "o": (HIDDEN, H * D), "gate_up": (2 * INTER, HIDDEN)}
    shapes["down"] = (HIDDEN, INTER)
    out = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * k**-0.5
        out[name] = (w, None, None) if fmt is None else Projection([pack(BlockTensor.quantize(w, fmt))], None, k)
    for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        out[name] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    out["q_norm"], out["k_norm"] = (1 + 0.1 * torch.randn(n, generator=gen) for n in (H * D, KV * D))
    return out


def _layers(variant):
    """(the whole layer, its attention half, the weights) of one variant."""
    _, fmt, qk_norm, norms = variant
    w = _weights(fmt)
    qk = {} if qk_norm is None else {"q_norm": w["q_norm"], "k_norm": w["k_norm"], "qk_norm": qk_norm}
    if qk_norm == "head":
        qk |= {"q_norm": w["q_norm"][:D].contiguous(), "k_norm": w["k_norm"][:D].contiguous()}
    post = {name: w[name] for name in ("post_attn_norm", "post_mlp_norm") if name in norms}
    pre = [w[name] if name in norms else None for name in ("attn_norm", "mlp_norm")]
    cap = {"softcap": 30.0} if len(norms) == 4 else {}

    def layer(gate_up, down):
        return cpu.DecoderLayerKernel(
            pre[0], w["qkv"], w["o"], pre[1], gate_up, down, H, KV, D, EPS, **qk, **post, **cap
        )

    return layer(w["gate_up"], w["down"]), layer(None, None), w


def _project(proj, x):
    if isinstance(proj, tuple):
        return cpu.Projection([proj[:2]], None, proj[0].shape[1])(x)
    return proj(x)


def _ffn_branch(w, norms, x, h):
    """The gated MLP's branch, per kernel, added to the residual stream (backends/layer.py's order)."""
    out = _project(w["down"], cpu.glu(_project(w["gate_up"], h), "silu"))
    if "post_mlp_norm" in norms:
        out = cpu.rms_norm(out, w["post_mlp_norm"], EPS)
    return x + out


def _run(layer, x, pools, start):
    """The layer on x's rows at positions start.. in place; returns what the call returns."""
    rope = torch.randn(CAPACITY, D, generator=torch.Generator().manual_seed(9))
    cos, sin = rope.cos(), rope.sin()
    n = x.shape[0]
    return layer(x, cos[start : start + n].contiguous(), sin[start : start + n].contiguous(), *pools, start, D**-0.5)


def _pools():
    return [torch.zeros(KV, CAPACITY, D) for _ in range(2)]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_the_attention_half_then_the_ffn_is_the_whole_layer(variant):
    whole, half, w = _layers(variant)
    assert (whole.ffn_kind, half.ffn_kind) == ("gated", "none") and half.inter == 0
    x = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(1))
    pools_whole, pools_half = _pools(), _pools()
    for start, n in ((0, 40), (40, 1), (41, 6), (47, 1)):  # a prefill, a step, a verification pass, a step
        a, b = x[start : start + n].clone(), x[start : start + n].clone()
        assert _run(whole, a, pools_whole, start) is None
        h = _run(half, b, pools_half, start)
        expected_h = b if "mlp_norm" not in variant[3] else cpu.rms_norm(b, w["mlp_norm"], EPS)
        assert h.shape == b.shape and torch.equal(h, expected_h)  # the FFN's input, the per-op norm's bits
        assert torch.equal(_ffn_branch(w, variant[3], b, h), a)
        for p, q in zip(pools_whole, pools_half):
            assert torch.equal(p[:, : start + n], q[:, : start + n])


@pytest.mark.parametrize("variant", VARIANTS[1:3], ids=[v[0] for v in VARIANTS[1:3]])
def test_a_row_of_the_attention_half_has_its_bits_alone_among_8_and_among_70(variant):
    _, half, _ = _layers(variant)
    x = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(2))
    pools = _pools()
    many = x.clone()
    h70 = _run(half, many, pools, 0).clone()
    row = 5
    for first, n in ((row, 1), (0, 8)):  # row 5 alone (positions 0..4 as the 70 rows wrote them), among 8
        part = x[first : first + n].clone()
        h = _run(half, part, [p.clone() for p in pools], first)
        assert torch.equal(h[row - first], h70[row]) and torch.equal(part[row - first], many[row])


def test_only_the_last_layer_of_a_stack_leaves_its_ffn_to_the_caller():
    whole, half, _ = _layers(VARIANTS[1])
    with pytest.raises(ValueError, match="only the last layer"):
        cpu.LayerStack([half, whole])
    stack = cpu.LayerStack([whole, half])
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(3))
    rows = cpu.PagedRows.contiguous(0, 3, 16)
    rope = [(torch.ones(3, D), torch.zeros(3, D))] * 2
    one_by_one = x.clone()
    assert whole(one_by_one, *rope[0], torch.zeros(KV, 16, D), torch.zeros(KV, 16, D), 0, 0.5) is None
    h_alone = half(one_by_one, *rope[1], torch.zeros(KV, 16, D), torch.zeros(KV, 16, D), 0, 0.5)
    pools = [torch.zeros(1, KV, 16, D) for _ in range(4)]
    h = stack(x, rope, pools[:2], pools[2:], rows, 0.5)
    assert torch.equal(x, one_by_one) and torch.equal(h, h_alone)


def test_half_an_ffn_is_refused():
    w = _weights("q8_0")
    with pytest.raises(ValueError, match="gate_up and down come together"):
        cpu.DecoderLayerKernel(None, w["qkv"], w["o"], None, w["gate_up"], None, H, KV, D, EPS)
