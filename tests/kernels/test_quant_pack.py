"""The C packer (``quant_pack.c``'s fd_pack_blocks, kernels/quant_pack.py's pack) writes the numpy
packer's bytes (pack_reference) for every GGUF type and the formats fastdecode quantizes to: one
part or several, rows as stored or in another order (BlockRows, or pack's row_order), row counts off
the group of eight, rows whose blocks do not fill the last pair, and on any number of threads."""

import numpy as np
import pytest
import torch
from gguf_files import random_raw

from fastdecode.formats.gguf import BlockLinear
from fastdecode.kernels import quant
from fastdecode.kernels.gguf_blocks import BlockRows, BlockTensor, file_blocks, llama_unpermute, stack_rows
from fastdecode.kernels.gguf_types import BLOCK_FORMATS
from fastdecode.kernels.quant_pack import pack_reference

needs_c = pytest.mark.skipif(quant.kernel_unavailable() is not None, reason=str(quant.kernel_unavailable()))
TYPES = list(BLOCK_FORMATS)  # every block type and F32 / F16 / BF16


def tensor(name: str, rows: int, cols: int, seed: int = 0) -> BlockTensor:
    return file_blocks(BLOCK_FORMATS[name].ggml_type, random_raw(name, rows, cols, seed), cols)


def widths(name: str) -> list[int]:
    """A whole number of pairs of blocks and one that leaves the last pair half empty (super-blocks: 1 and 3;
    MXFP4's units of four: whole, and the last one with 3 or 1 of its blocks)."""
    f = BLOCK_FORMATS[name]
    if name == "mxfp4":
        return [128, 96, 160]
    return [256, 768] if f.k_quant else [64, 96] if not f.is_float else [40, 100]


def assert_same(ours: quant.PackedBlocks, ref: quant.PackedBlocks) -> None:
    assert (ours.format, ours.rows, ours.cols) == (ref.format, ref.rows, ref.cols)
    assert torch.equal(ours.data, ref.data)
    assert ours.data.data_ptr() % 64 == 0


@needs_c
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 8, 13, 21])
def test_one_part_as_stored_and_in_another_order(name, rows):
    for cols in widths(name):
        bt = tensor(name, rows, cols, seed=rows)
        assert_same(quant.pack(bt), pack_reference(bt))
        order = np.random.default_rng(rows).permutation(rows)
        ref = pack_reference(bt.take_rows(order))
        assert_same(quant.pack(bt, row_order=order), ref)
        assert_same(quant.pack(bt.view_rows(order)), ref)
        assert_same(pack_reference(bt.view_rows(order)), ref)


@needs_c
@pytest.mark.parametrize("name", TYPES)
def test_several_parts_packed_as_their_stack(name):
    cols = widths(name)[-1]
    q, k, v = (tensor(name, n, cols, seed=n) for n in (16, 8, 5))  # 29 rows: the last group padded
    stacked = stack_rows([q, k, v])
    assert_same(quant.pack([q, k, v]), pack_reference(stacked))
    assert_same(pack_reference([q, k, v]), pack_reference(stacked))
    # Llama's q and k un-permuted where they lie, v as stored (BlockLinear's fused QKV)
    q_rows, k_rows = q.view_rows(llama_unpermute(16, 2)), k.view_rows(llama_unpermute(8, 1))
    ref = pack_reference(stack_rows([q.take_rows(q_rows.order), k.take_rows(k_rows.order), v]))
    assert_same(quant.pack([q_rows, k_rows, v]), ref)
    assert_same(pack_reference([q_rows, k_rows, v]), ref)
    # an order over the stack: a subset, rows repeated, across the parts
    order = np.array([28, 0, 17, 3, 3, 24, 9, 16, 1, 27, 8])
    assert_same(quant.pack([q, k, v], row_order=order), pack_reference(stacked.take_rows(order)))


@needs_c
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("rows, cols", [(1, 32), (13, 40), (21, 96), (8, 200)])
def test_the_formats_fastdecode_quantizes_to(fmt, rows, cols):
    """Rows padded to whole blocks (cols 40, 200), an odd number of blocks (cols 96: 3, 200: 7)."""
    bt = BlockTensor.quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)), fmt)
    assert_same(quant.pack(bt), pack_reference(bt))
    order = np.arange(rows)[::-1].copy()
    assert_same(quant.pack(bt, row_order=order), pack_reference(bt.take_rows(order)))


@needs_c
def test_strided_rows_zero_rows_and_threads():
    bt = tensor("q4_k", 24, 512)
    # rows read in place with a stride of their own (every other row of a wider array)
    wide = np.zeros((48, bt.blocks.shape[1]), np.uint8)
    wide[::2] = bt.blocks
    assert_same(quant.pack(BlockTensor(bt.format, wide[::2], bt.cols)), pack_reference(bt))
    empty = quant.pack(bt, row_order=np.zeros(0, np.int64))
    assert empty.rows == 0 and empty.data.numel() == 0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant.pack(bt).data
        torch.set_num_threads(2)
        assert torch.equal(quant.pack(bt).data, one)
    finally:
        torch.set_num_threads(threads)


def test_bad_parts_and_orders_are_refused():
    q8, q4 = tensor("q8_0", 8, 64), tensor("q4_0", 8, 64)
    with pytest.raises(ValueError, match="differ in format"):
        quant.pack([q8, q4])
    with pytest.raises(ValueError, match="differ in format"):
        quant.pack([q8, tensor("q8_0", 8, 96)])
    with pytest.raises(ValueError, match="indexes 16 rows"):
        quant.pack([q8, q8], row_order=np.array([0, 16]))
    with pytest.raises(ValueError, match="1-D integer"):
        quant.pack(q8, row_order=np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="indexes 8 rows"):
        BlockRows(q8, np.array([-1, 2]))


@needs_c
def test_block_linear_packs_row_views_in_place():
    """A fused QKV whose q and k are row views gives the bits of one built from copied rows, on the C
    kernels and the torch reference."""
    q, k, v = (tensor("q6_k", n, 256, seed=n) for n in (16, 8, 8))
    oq, ok = llama_unpermute(16, 2), llama_unpermute(8, 1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(32)
    copied = BlockLinear([q.take_rows(oq), k.take_rows(ok), v], bias)
    viewed = BlockLinear([q.view_rows(oq), k.view_rows(ok), v], bias)
    assert viewed.out_features == 32 and viewed.data_bytes() == copied.data_bytes()
    assert torch.equal(viewed(x), copied(x))
    assert torch.equal(BlockLinear([q.view_rows(oq), k.view_rows(ok), v], bias, "torch")(x), copied(x))


def test_without_the_library_pack_is_the_numpy_packer(monkeypatch):
    from fastdecode.kernels import quant_pack

    q, k = tensor("q5_k", 8, 256), tensor("q5_k", 5, 256, seed=1)
    parts = [q.view_rows(np.arange(8)[::-1]), k]
    expected = pack_reference([q.take_rows(np.arange(8)[::-1]), k])
    monkeypatch.setattr(quant_pack, "rowgemm_unavailable", lambda: "no library here")
    monkeypatch.setattr(quant_pack, "_kernel", lambda: pytest.fail("the library was called"))
    assert_same(quant.pack(parts), expected)
