"""The 2:4 sparse kernels (kernels/sparse.c: Q8_0, kernels/sparse_f32.c: float32; packed by
kernels/sparse.py): bit for bit the dense Q8_0 / float32 kernel over the same pruned weights, at
every row count and on every implementation."""

from pathlib import Path

import pytest
import torch
from block_checks import ALL_IMPLS, block_acts

from fastdecode.kernels import abi
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.kernels.quant import Projection, block_linear_reference, kernel_unavailable, pack
from fastdecode.kernels.sparse import is_2_4, pack_s24, pack_s24_f32, sparse_bytes, sparse_f32_bytes
from fastdecode.quant.sparsity import nm_mask

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=str(kernel_unavailable()))


def _pruned_q8_0(rows: int, cols: int, seed: int = 0) -> BlockTensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return BlockTensor.quantize(w * nm_mask(w.abs(), 2, 4), "q8_0")


S24_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 17, 70)  # every row tile of the ymm and zmm loops, a second row block


@needs_kernel
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize(
    "rows, cols", [(24, 64), (13, 96), (8, 36), (40, 1536)]
)  # outputs not a multiple of 8; a padded block; an odd group count
def test_sparse_output_is_the_dense_q8_0_output_bit_for_bit_at_every_row_count(impl, rows, cols):
    bt = _pruned_q8_0(rows, cols)
    bias = torch.randn(rows)
    dense = Projection([pack(bt)], bias, cols)
    sparse = Projection([pack_s24(bt)], bias, cols, impl=impl)
    x = block_acts(70, cols)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):  # threads split the output groups, never a block's sum
            torch.set_num_threads(threads)
            full = sparse(x)
            for m in S24_ROWS:
                y = sparse(x[:m])
                assert torch.equal(y, dense(x[:m])), (threads, m)
                assert torch.equal(y, block_linear_reference(x[:m], [bt], bias)), (threads, m)
                assert torch.equal(y, full[:m]), (threads, m)  # row-invariant: a row's bits whatever the rows beside it
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_a_fused_projection_mixes_sparse_and_dense_parts():
    q, k = _pruned_q8_0(16, 64, 2), BlockTensor.quantize(torch.randn(8, 64), "q8_0")
    x = torch.randn(5, 64)
    fused = Projection([pack_s24(q), pack(k)], None, 64)
    assert torch.equal(fused(x), Projection([pack(q), pack(k)], None, 64)(x))


def test_the_layout_stores_the_kept_half():
    bt = _pruned_q8_0(16, 64)
    packed = pack_s24(bt)
    assert packed.format == "s24_q8" and packed.data.numel() == sparse_bytes(16, 64)
    assert sparse_bytes(16, 64) < 0.7 * pack(bt).data.numel()  # 22 bytes a block of a row where q8_0 takes 34
    assert is_2_4(bt.fields()[0])
    dense = BlockTensor.quantize(torch.randn(8, 64), "q8_0")
    assert not is_2_4(dense.fields()[0])
    with pytest.raises(ValueError, match="not 2:4"):
        pack_s24(dense)
    with pytest.raises(ValueError, match="q8_0"):
        pack_s24(BlockTensor.quantize(torch.randn(8, 64), "q4_0"))


def test_the_format_code_is_declared_once_in_the_c_source():
    source = (Path(abi.__file__).with_name("quant.c")).read_text()
    assert f"#define FD_W_S24_Q8 {abi.WEIGHT_FORMATS['s24_q8']}" in source
    assert '#include "sparse.c"' in (Path(abi.__file__).with_name("cpu.c")).read_text()


# ---------------------------------------------------------------- 2:4 sparse float32 (sparse_f32.c)


def _pruned_f32(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """float32 [rows, cols] pruned 2:4 by magnitude, +0.0 where pruned."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return torch.where(nm_mask(w.abs(), 2, 4), w, torch.zeros(()))


F32_ROWS = (1, 3, 8, 17, 48, 70)  # one row (fused), the row blocks, the 3x4 tiles from 48 rows on


@needs_kernel
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("rows, cols", [(24, 64), (13, 100), (8, 36), (16, 1540)])  # a K % 8 tail; x past L1
def test_sparse_f32_output_is_the_dense_float32_output_bit_for_bit_at_every_row_count(impl, rows, cols):
    w, bias = _pruned_f32(rows, cols), torch.randn(rows)
    dense = Projection([(w, None)], bias, cols)
    sparse = Projection([pack_s24_f32(w)], bias, cols, impl=impl)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):  # threads split the outputs, never a reduction
            torch.set_num_threads(threads)
            for m in F32_ROWS:
                y = sparse(x[:m])
                assert torch.equal(y, dense(x[:m])), (threads, m)
                assert torch.equal(y, sparse(x)[:m]), (threads, m)  # row-invariant
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_the_f32_check_sees_a_changed_reduction_order():
    """The data above tell orders apart: the same products summed in another order (torch's GEMM,
    or the dense kernel's lanes summed the other way round) do not give the kernel's bits."""
    w, x = _pruned_f32(16, 1540), torch.randn(70, 1540, generator=torch.Generator().manual_seed(1))
    y = Projection([pack_s24_f32(w)], None, 1540)(x)
    assert not torch.equal(y, x @ w.T)
    assert not torch.equal(y, x.flip(-1) @ w.flip(-1).T)


def test_the_f32_layout_stores_the_kept_half():
    w = _pruned_f32(16, 64)
    packed = pack_s24_f32(w)
    assert packed.format == "s24_f32" and packed.data.numel() == sparse_f32_bytes(16, 64)
    assert sparse_f32_bytes(64, 1024) == 64 * 1024 // 32 * 68  # 68 bytes a row's 32 weights where float32 takes 128
    with pytest.raises(ValueError, match="not 2:4"):
        pack_s24_f32(torch.randn(8, 64))
    with pytest.raises(ValueError, match="float32"):
        pack_s24_f32(w[:, :30].contiguous())


@needs_kernel
def test_an_f32_part_comes_alone():
    w = _pruned_f32(8, 64)
    with pytest.raises(ValueError, match="one part"):
        Projection([pack_s24_f32(w), pack(BlockTensor.quantize(w, "q8_0"))], None, 64)
    source = (Path(abi.__file__).with_name("quant.c")).read_text()
    assert f"#define FD_W_S24_F32 {abi.WEIGHT_FORMATS['s24_f32']}" in source
