"""The experts FFN in one C call (``kernels/experts.py``, ``experts.c``): the bits of the per-op path (each
expert's projections and GLU called one by one, each row's k outputs times their weights added in rank
order) in Q8_0, Q4_0, the Q4_K_M mix (Q4_K gate and up, Q6_K down) and MXFP4, on every implementation
this CPU runs (the portable scalar loop included); gpt-oss's experts (biased gate_up and down, the clamped
SwiGLU) too; a row's bits alone, among 8 and among 70 rows, on one thread and two; experts with no rows
skipped; bad input refused by one clear error. The AVX-512 VNNI and AVX-VNNI implementations are skipped
where the CPU lacks them (the Zen 3 host): they are compiled, and their tests run where they can."""

import pytest
import torch
from block_checks import ALL_IMPLS
from gguf_files import random_raw

from fastdecode.kernels import quant
from fastdecode.kernels.cpu import clamped_glu, glu
from fastdecode.kernels.experts import ExpertsKernel, experts_unsupported
from fastdecode.kernels.gguf_blocks import BlockTensor, file_blocks
from fastdecode.kernels.gguf_types import BLOCK_FORMATS

pytestmark = pytest.mark.skipif(quant.kernel_unavailable() is not None, reason=str(quant.kernel_unavailable()))

# name -> (gate and up's type, down's type, hidden, inter): shapes off the tiles and blocks where the type allows
MIXES = {
    "q8_0": ("q8_0", "q8_0", 160, 44),  # down's inputs a block and a tail of 12; gate_up's 88 outputs 11 groups
    "q4_0": ("q4_0", "q4_0", 96, 136),  # gate_up's 272 outputs: two tiles of 16 groups and a part
    "q4_k_m": ("q4_k", "q6_k", 256, 256),  # llama.cpp's Q4_K_M: Q4_K gate and up, Q6_K down
    "mxfp4": ("mxfp4", "mxfp4", 192, 128),  # gpt-oss's experts' type (K a unit of four blocks and a half)
}
N_EXPERTS, TOP_K = 8, 3


def _blocks(name: str, rows: int, cols: int, seed: int) -> BlockTensor:
    if name in ("q8_0", "q4_0"):
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1
        return BlockTensor.quantize(w, name)
    return file_blocks(BLOCK_FORMATS[name].ggml_type, random_raw(name, rows, cols, seed, scale=2e-3), cols)


def _experts(mix: str, split: bool = False, biased: bool = False):
    """Per expert: gate_up (gate and up one packed part, or with ``split`` two) and down Projections; with
    ``biased`` each with a random bias (gpt-oss's)."""
    up_type, down_type, hidden, inter = MIXES[mix]
    gate_up, down = [], []
    gen = torch.Generator().manual_seed(11)
    bias = lambda n: torch.randn(n, generator=gen) * 0.5 if biased else None  # noqa: E731
    for e in range(N_EXPERTS):
        gate, up = _blocks(up_type, inter, hidden, 10 * e), _blocks(up_type, inter, hidden, 10 * e + 1)
        parts = [quant.pack(gate), quant.pack(up)] if split else [quant.pack([gate, up])]
        gate_up.append(quant.Projection(parts, bias(2 * inter), hidden))
        down.append(quant.Projection([quant.pack(_blocks(down_type, hidden, inter, 10 * e + 2))], bias(hidden), inter))
    return gate_up, down


def _routing(n: int, seed: int = 0, experts: int = N_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's TOP_K distinct experts among the first ``experts`` and their float32 weights."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=gen)[:TOP_K] for _ in range(n)])
    return index, torch.softmax(torch.randn(n, TOP_K, generator=gen), -1)


def _acts(n: int, hidden: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 2
    if n > 3:
        x[3] = 0.0
    return x


def per_op(gate_up, down, x, index, weights, clamp=None) -> torch.Tensor:
    """The per-op path: each (row, rank) through its expert's projections and GLU (``clamp``: gpt-oss's
    clamped SwiGLU) one call at a time, as ``ExpertsMLP`` runs them (an expert's rows together), times its
    weight; each row's k in rank order."""
    act = glu if clamp is None else lambda gu: clamped_glu(gu, *clamp)
    slots = torch.zeros(x.shape[0], TOP_K, x.shape[1])
    for e in torch.unique(index).tolist():
        rows, rank = (index == e).nonzero(as_tuple=True)
        slots[rows, rank] = down[e](act(gate_up[e](x[rows].contiguous()))) * weights[rows, rank, None]
    out = slots[:, 0]
    for j in range(1, TOP_K):
        out = out + slots[:, j]
    return out


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("mix", list(MIXES))
def test_one_call_gives_the_per_op_bits(mix, impl):
    gate_up, down = _experts(mix)
    fused = ExpertsKernel(gate_up, down, impl=impl)
    x = _acts(70, MIXES[mix][2])
    index, weights = _routing(70)
    out, run = fused(x, index, weights)
    ref = per_op(gate_up, down, x, index, weights)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert torch.equal(out, ref) and run == len(torch.unique(index))
    one, _ = fused(x[:1], index[:1], weights[:1])  # a decode step: one row, TOP_K experts
    assert torch.equal(one, ref[:1])


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("mix", ["mxfp4", "q4_0"])
def test_gpt_oss_s_biased_clamped_experts_give_the_per_op_bits(mix, impl):
    """gate_up and down with biases, the clamped SwiGLU (alpha 1.702, limit 7: gpt-oss's; a limit of 0.5
    clamps most elements): the per-op bits, a row's alone and among 8 the same, gate and up as one part or two."""
    hidden = MIXES[mix][2]
    x = _acts(70, hidden, seed=7)
    index, weights = _routing(70, seed=8)
    for clamp, split in (((1.702, 7.0), False), ((1.702, 0.5), True)):
        gate_up, down = _experts(mix, split=split, biased=True)
        fused = ExpertsKernel(gate_up, down, impl=impl, clamp=clamp)
        out, run = fused(x, index, weights)
        ref = per_op(gate_up, down, x, index, weights, clamp)
        assert torch.isfinite(ref).all() and run == len(torch.unique(index))
        assert torch.equal(out, ref), clamp
        assert not torch.equal(ref, per_op(gate_up, down, x, index, weights))  # the clamp and biases took effect
        among8, _ = fused(x[:8], index[:8], weights[:8])
        alone, _ = fused(x[5:6], index[5:6], weights[5:6])
        assert torch.equal(among8, ref[:8]) and torch.equal(alone[0], ref[5])


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_gate_and_up_as_two_parts(impl):
    gate_up, down = _experts("q4_k_m", split=True)
    x, (index, weights) = _acts(9, 256), _routing(9, seed=3)
    out, _ = ExpertsKernel(gate_up, down, impl=impl)(x, index, weights)
    assert torch.equal(out, per_op(gate_up, down, x, index, weights))


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("mix", ["q4_0", "q4_k_m"])
def test_a_row_gets_its_bits_alone_among_8_and_among_70(mix, impl):
    fused = ExpertsKernel(*_experts(mix), impl=impl)
    x = _acts(70, MIXES[mix][2], seed=5)
    index, weights = _routing(70, seed=6)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            among70, _ = fused(x, index, weights)
            among8, _ = fused(x[:8], index[:8], weights[:8])
            assert torch.equal(among8, among70[:8]), threads
            for row in (0, 3, 5):
                alone, _ = fused(x[row : row + 1], index[row : row + 1], weights[row : row + 1])
                assert torch.equal(alone[0], among70[row]), (threads, row)
    finally:
        torch.set_num_threads(before)


def test_experts_with_no_rows_are_skipped():
    gate_up, down = _experts("q8_0")
    fused = ExpertsKernel(gate_up, down)
    x = _acts(5, 160)
    index, weights = _routing(5, seed=2, experts=4)  # experts 4..7 get no row
    out, run = fused(x, index, weights)
    assert run == len(torch.unique(index)) <= 4
    assert torch.equal(out, per_op(gate_up, down, x, index, weights))
    every_row_one_expert = torch.tensor([[6, 2, 0]] * 5)
    out, run = fused(x, every_row_one_expert, weights)
    assert run == 3 and torch.equal(out, per_op(gate_up, down, x, every_row_one_expert, weights))
    empty, run = fused(x[:0], index[:0], weights[:0])
    assert empty.shape == (0, 160) and run == 0


def test_bad_input_is_one_clear_error():
    gate_up, down = _experts("q8_0")
    with pytest.raises(ValueError, match=r"expert 2 has gate_up \[88, 160\] and down \[88, 160\]"):
        ExpertsKernel(gate_up, [*down[:2], gate_up[0], *down[3:]])
    with pytest.raises(ValueError, match="8 gate_up and 7 down"):
        ExpertsKernel(gate_up, down[:7])
    float_down = quant.Projection([(torch.randn(160, 44), None)], None, 44)
    assert "f32 weights" in experts_unsupported(float_down)
    with pytest.raises(ValueError, match="expert 0: f32 weights"):
        ExpertsKernel(gate_up, [float_down, *down[1:]])
    with pytest.raises(ValueError, match="unknown activation"):
        ExpertsKernel(gate_up, down, activation="relu")
    with pytest.raises(ValueError, match=r"clamp must be \(alpha, limit\)"):
        ExpertsKernel(gate_up, down, clamp=(1.702, 0.0))
    fused = ExpertsKernel(gate_up, down)
    x, (index, weights) = _acts(4, 160), _routing(4)
    with pytest.raises(ValueError, match=r"x must be float32 CPU rows \[n, 160\]"):
        fused(x[:, :100], index, weights)
    with pytest.raises(ValueError, match=r"index must be \[4, k\]"):
        fused(x, index[:3], weights)
    with pytest.raises(ValueError, match=r"weights must be float32 CPU \[4, 3\]"):
        fused(x, index, weights[:, :2])
    with pytest.raises(ValueError, match="expert index 8 is not one of the 8 experts"):
        fused(x, torch.where(index == 1, 8, index), weights)
    with pytest.raises(ValueError, match="expert index -1"):
        fused(x, torch.where(index == 1, -1, index), weights)


# -- the router's choice in C (route_rows: fd_route_f32) and the FFN as a layer call's part (MoEKernel)


@pytest.mark.parametrize(
    ("gating", "renormalize"), [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]
)
def test_routing_in_c_is_torch_s_choice_and_a_row_s_own(gating, renormalize):
    """route_rows against backends/ffn.py's torch route: the same experts in the same ranks, weights within
    float32 rounding (C's expf, torch's vectorised exp); each row alone gets the bits it gets among 70; the
    caller's logits untouched."""
    from fastdecode.architectures import Experts
    from fastdecode.backends.ffn import route
    from fastdecode.kernels.experts import route_rows

    logits = torch.randn(70, 64, generator=torch.Generator().manual_seed(5)) * 3
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top: the lower expert first
    before = logits.clone()
    weights, index = route_rows(logits, 8, gating, renormalize)
    assert torch.equal(logits, before)
    ref_w, ref_i = route(logits, Experts(64, 8, gating, renormalize=renormalize))
    assert torch.equal(index, ref_i) and index[3, :2].tolist() == [10, 20]
    assert torch.allclose(weights, ref_w, rtol=1e-6, atol=1e-7)
    for r in (0, 3, 69):
        w, i = route_rows(logits[r : r + 1], 8, gating, renormalize)
        assert torch.equal(w[0], weights[r]) and torch.equal(i[0], index[r])
    with pytest.raises(ValueError, match="routing"):
        route_rows(logits, 65, gating, renormalize)
    with pytest.raises(ValueError, match="float32 CPU"):
        route_rows(logits.double(), 8, gating, renormalize)


def test_a_row_of_nan_logits_routes_to_valid_experts():
    """NaN logits (a broken model) still give expert ids the experts kernel accepts, never a wild index."""
    from fastdecode.kernels.experts import route_rows

    logits = torch.full((2, 8), float("nan"))
    logits[1, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    _, index = route_rows(logits, 3, "topk_softmax", False)
    assert ((index >= 0) & (index < 8)).all()


def test_the_moe_kernel_takes_a_float32_router_of_the_experts_shape():
    from fastdecode.kernels.experts import MoEKernel

    gate_up, down = _experts("q8_0")
    experts = ExpertsKernel(gate_up, down)
    hidden = MIXES["q8_0"][2]
    router = quant.Projection([(torch.randn(N_EXPERTS, hidden), None)], None, hidden)
    moe = MoEKernel(router, experts, TOP_K, "softmax_topk", True)
    assert moe.desc.top_k == TOP_K and moe.desc.renormalize == 1
    with pytest.raises(ValueError, match="router"):
        MoEKernel(
            quant.Projection([(torch.randn(N_EXPERTS + 1, hidden), None)], None, hidden), experts, 2, "softmax_topk", 0
        )
    with pytest.raises(ValueError, match="float32"):
        MoEKernel(gate_up[0], experts, 2, "softmax_topk", False)
    with pytest.raises(ValueError, match="routing"):
        MoEKernel(router, experts, TOP_K, "sigmoid", False)
