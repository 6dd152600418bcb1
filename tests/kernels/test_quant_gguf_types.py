"""Every GGUF block type on the integer kernels (fastdecode.kernels.quant): packed compactly, the
torch reference's bits on every path the CPU offers, within the block kernels' tolerance of the
exact product, and every row's bits its own at 1-8 and 70 rows."""

import numpy as np
import pytest
import torch
from block_checks import ALL_IMPLS, assert_rows_bitwise_invariant, block_acts
from gguf_files import BLOCK_TYPES, random_raw, unit_scales

from fastdecode.kernels import quant
from fastdecode.kernels.gguf_blocks import BlockTensor, file_blocks
from fastdecode.kernels.gguf_types import BLOCK_FORMATS, GGUF_TYPES

TYPES = list(BLOCK_TYPES)  # every block type
needs_c = pytest.mark.skipif(quant.kernel_unavailable() is not None, reason=str(quant.kernel_unavailable()))


def blocks(name: str, rows: int, cols: int, seed: int = 0) -> BlockTensor:
    return file_blocks(BLOCK_FORMATS[name].ggml_type, random_raw(name, rows, cols, seed), cols)


def _dequantized_acts(x):
    q, d = quant.quantize_rows_reference(x)[:2]
    return (q.double() * d.double()[..., None]).reshape(x.shape[0], -1)[:, : x.shape[1]]


@pytest.mark.parametrize("name", TYPES)
def test_packed_bytes_a_weight_are_the_tables(name):
    bt = blocks(name, 64, 1024)
    entry = next(t for t in GGUF_TYPES.values() if t.format.name == name)
    assert quant.pack(bt).data.numel() == entry.packed_bytes_per_weight * 64 * 1024
    # chunked packing: slices of rows give the same bytes as the whole
    whole = quant.pack(bt).data
    parts = [quant.pack(bt.take_rows(np.arange(lo, lo + 16))).data for lo in range(0, 64, 16)]
    assert torch.equal(whole, torch.cat(parts))


@needs_c
@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_tensors_keep_their_bytes_and_give_the_float32_gemms_bits(name):
    """F16 / BF16 weights stay 16-bit (widened in registers): every row the bits the float32 GEMM gives
    over the widened weight, at 1-8 and 70 rows, K with a tail past its vectors of 8, N past its blocks."""
    n, k = 21, 100
    bt = file_blocks(BLOCK_FORMATS[name].ggml_type, random_raw(name, n, k, seed=6), k)
    packed = quant.pack(bt)
    assert packed.format == name and packed.data.numel() == bt.blocks.size  # the file's bytes
    with pytest.raises(ValueError, match="one part"):
        quant.Projection([packed, packed], None, k)
    bias = torch.randn(n)
    ours = quant.Projection([packed], bias, k)
    widened = quant.Projection([(bt.dequantize(), None)], bias, k)
    x = block_acts(70, k, seed=7)
    full = widened(x)
    assert torch.equal(ours(x), full)
    for m in range(1, 9):
        assert torch.equal(ours(x[:m]), full[:m]) and torch.equal(ours(x[60 : 60 + m]), full[60 : 60 + m]), m


@needs_c
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", [(1, 256), (13, 512), (45, 256)])
def test_kernels_equal_the_reference_and_a_float_reference(name, n, k):
    bt = blocks(name, n, k, seed=n)
    bias = torch.randn(n)
    packed = quant.pack(bt)
    for m in (1, 7, 16):
        x = block_acts(m, k, seed=m)
        ref = quant.block_linear_reference(x, [bt], bias)
        for impl in quant.supported_impls():
            assert torch.equal(quant.Projection([packed], bias, k, impl)(x), ref), (impl, m)
        # the same blocks in float64: only the float32 roundings of the block sums differ
        exact = _dequantized_acts(x) @ bt.dequantize().double().T + bias.double()
        scale = _dequantized_acts(x).abs() @ bt.dequantize().double().abs().T + 1
        assert ((ref.double() - exact).abs() <= 1e-6 * scale).all()


@needs_c
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_extreme_codes_do_not_overflow_the_int16_sums(name, fill):
    """Every quant and scale byte at its lowest or highest (scales 1.0) against activations of +-127:
    the ymm loop's int16 partial sums hold (Q5's codes of 31 four chunks at a time, IQ4's -127)."""
    f = BLOCK_FORMATS[name]
    b = np.full((8, 256 // f.block_weights, f.block_bytes), fill, np.uint8)
    unit_scales(name, b)
    bt = file_blocks(f.ggml_type, b.reshape(8, -1), 256)
    x = torch.full((3, 256), 2.0)
    x[1, ::2] = -2.0
    ref = quant.block_linear_reference(x, [bt])
    for impl in quant.supported_impls():
        assert torch.equal(quant.Projection([quant.pack(bt)], None, 256, impl)(x), ref), impl
    torch.testing.assert_close(ref.double(), x.double() @ bt.dequantize().double().T, rtol=1e-6, atol=1e-6)


@needs_c
@pytest.mark.parametrize("name", TYPES)
def test_rows_are_bitwise_invariant_to_row_count_and_threads(name):
    n, k = 45, 512  # an odd last group
    bt = blocks(name, n, k, seed=3)
    x = block_acts(16, k)
    full = assert_rows_bitwise_invariant(bt, x)
    for m in (1, 5, 16):
        assert torch.equal(quant.block_linear_reference(x[m - 1 : m], [bt]), full[m - 1 : m]), m


@needs_c
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("name", TYPES)
def test_a_70_row_pass_gives_each_row_the_bits_of_1_to_8_rows(name, impl):
    """70 rows (row blocks of 64, tiles of 8, a tile of 6 left) on each implementation: every row
    the bits it gets in passes of 1 to 8 rows, on one thread and two."""
    k = 256
    bt = blocks(name, 21, k, seed=4)
    proj = quant.Projection([quant.pack(bt)], None, k, impl)
    x = block_acts(70, k, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = proj(x)
        assert torch.equal(full, quant.block_linear_reference(x, [bt]))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in range(1, 9):
                for lo in (0, 62, 69 - m + 1):
                    assert torch.equal(proj(x[lo : lo + m]), full[lo : lo + m]), (threads, m, lo)
    finally:
        torch.set_num_threads(before)


@needs_c
def test_a_fused_projection_of_new_and_old_types():
    """A fused QKV or gate_up whose parts differ in type: each part its own kernel."""
    k = 256
    parts = [blocks("q5_k", 16, k, 1), blocks("q3_k", 5, k, 2), blocks("iq4_nl", 11, k, 3), blocks("q2_k", 3, k, 4)]
    bias = torch.randn(35)
    x = block_acts(6, k)
    y = quant.Projection([quant.pack(p) for p in parts], bias, k)(x)
    assert torch.equal(y, quant.block_linear_reference(x, parts, bias))


@needs_c
def test_mxfp4_experts_gate_and_up_beside_other_types():
    """gpt-oss's expert weights: MXFP4 parts in a fused projection beside IQ4_NL and Q8_0, rows off the
    group of eight, K a unit of four blocks and a half (the last unit's two missing blocks never read)."""
    k = 192
    parts = [blocks("mxfp4", 13, k, 1), blocks("iq4_nl", 8, k, 2), blocks("mxfp4", 5, k, 3), blocks("q8_0", 3, k, 4)]
    bias = torch.randn(29)
    x = block_acts(11, k)
    ref = quant.block_linear_reference(x, parts, bias)
    for impl in quant.supported_impls():
        proj = quant.Projection([quant.pack(p) for p in parts], bias, k, impl)
        assert torch.equal(proj(x), ref), impl
        for m in (1, 3, 8):
            assert torch.equal(proj(x[:m]), ref[:m]), (impl, m)
