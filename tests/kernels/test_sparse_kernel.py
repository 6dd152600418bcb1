"""The 2:4 sparse Q8_0 kernel (kernels/sparse.c, kernels/sparse.py): bit for bit the dense Q8_0
kernel over the same pruned weights, at every row count and on every implementation."""

from pathlib import Path

import pytest
import torch
from block_checks import ALL_IMPLS

from fastdecode.gguf_blocks import BlockTensor
from fastdecode.kernels import abi
from fastdecode.kernels.quant import Projection, block_linear_reference, kernel_unavailable, pack
from fastdecode.kernels.sparse import is_2_4, pack_s24, sparse_bytes
from fastdecode.quant.sparsity import nm_mask

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=str(kernel_unavailable()))


def _pruned_q8_0(rows: int, cols: int, seed: int = 0) -> BlockTensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return BlockTensor.quantize(w * nm_mask(w.abs(), 2, 4), "q8_0")


@needs_kernel
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("rows, cols", [(24, 64), (13, 96), (8, 36)])  # outputs not a multiple of 8; a padded block
def test_sparse_output_is_the_dense_q8_0_output_bit_for_bit_at_every_row_count(impl, rows, cols):
    bt = _pruned_q8_0(rows, cols)
    bias = torch.randn(rows)
    dense = Projection([pack(bt)], bias, cols)
    sparse = Projection([pack_s24(bt)], bias, cols, impl=impl)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(1))
    for m in (1, 3, 5, 7, 8, 17, 70):  # every row tile of the zmm loop among them
        y = sparse(x[:m])
        assert torch.equal(y, dense(x[:m])), m
        assert torch.equal(y, block_linear_reference(x[:m], [bt], bias)), m
        assert torch.equal(y, sparse(x)[:m]), m  # row-invariant: a row's bits whatever the rows beside it


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
