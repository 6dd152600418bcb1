"""A block tensor in ``quant.c``'s layout (:func:`pack`): groups of eight outputs, each group its
blocks in units (a pair of blocks, or a super-block), a unit its scales then its quants, the eight
rows' quants interleaved four weights at a time and split into bit planes (``quant.c``'s comment
gives the layout byte by byte).

Bytes a weight once packed (whole groups of eight rows; a unit's missing last blocks padded):
Q8_0 1.0625, Q4_0 and IQ4_NL 0.5625, Q4_1 0.625, Q5_0 0.6875, Q5_1 0.75, Q2_K 0.328, Q3_K 0.453,
Q4_K 0.578, Q5_K 0.703, Q6_K 0.828, IQ4_XS 0.547, MXFP4 0.531: the file's bits, the super-block
formats' scales padded to a multiple of 32 bytes (MXFP4's one-byte scales fill 32 bytes over a unit
of four blocks; ``fastdecode.kernels.gguf_types.GGUF_TYPES`` has both figures).

:func:`pack` runs the C library's ``fd_pack_blocks`` (``quant_pack.c``): each group of eight rows
read from the stored blocks in place (several parts of a fused projection, rows in any order) and
written once, over the kernel threads, so loading a model costs about a memory copy of its weights
and no temporary but the packed output. The numpy packer here (:func:`pack_reference`) defines
the layout, and serves where the library cannot load: the same bytes (tests/kernels/test_quant_pack.py).
It goes a slice of rows at a time, so a tensor's temporaries stay a few tens of MB whatever its size
(an 8B model's LM head is half a billion weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastdecode.kernels.abi import GROUP, WEIGHT_FORMATS, PackedBlocks
from fastdecode.kernels.arena import packed_buffer
from fastdecode.kernels.cpu import _kernel, rowgemm_unavailable
from fastdecode.kernels.gguf_blocks import BlockRows, BlockTensor, check_row_order
from fastdecode.kernels.gguf_types import IQ4_VALUES

# A format's quants as quant.c stores them: its planes, each (bits, at): a plane of bits-wide fields
# holding bits at .. at + bits - 1 of each weight's code u, in this order; u = q + _CODE_BIAS (IQ4:
# the index of q's level; MXFP4: the stored nibble, whose level has two indices for 0).
_PLANES: dict[str, tuple[tuple[int, int], ...]] = {
    "q8_0": ((8, 0),),
    **dict.fromkeys(("q4_0", "q4_1", "q4_k", "iq4_nl", "iq4_xs", "mxfp4"), ((4, 0),)),
    **dict.fromkeys(("q5_0", "q5_1", "q5_k"), ((4, 0), (1, 4))),
    "q6_k": ((4, 0), (2, 4)),
    "q3_k": ((2, 0), (1, 2)),
    "q2_k": ((2, 0),),
}
_CODE_BIAS = {"q6_k": 32, "q3_k": 4}
_SUPER_BLOCKS = 8  # blocks of 32 a super-block: quant.c's unit for the super-block formats
_UNIT_BLOCKS = {"mxfp4": 4}  # blocks of 32 a unit of the other formats: 2 (a pair), MXFP4's 4 (32 bytes of e[8])
_UNIT_SCALE_BYTES = {"iq4_xs": 96}  # a super-block's scales padded to a multiple of 32 bytes; 160 for the others
_CHUNK_WEIGHTS = 1 << 22  # weights packed at a time


def _codes(fmt: str, q: np.ndarray) -> np.ndarray:
    """q [R, nb, 32] (BlockTensor.fields') -> the codes u quant.c decodes, uint8."""
    if fmt.startswith("iq4"):
        return np.searchsorted(IQ4_VALUES, q).astype(np.uint8)  # q is one of the levels, which ascend
    if fmt in _CODE_BIAS:
        return (q.astype(np.int16) + _CODE_BIAS[fmt]).astype(np.uint8)
    return q.view(np.uint8) if q.dtype == np.int8 else q.astype(np.uint8)


def _plane(u: np.ndarray, bits: int, at: int) -> np.ndarray:
    """Codes u [8 G, nb, 32] -> one plane, [G, nb, 32 * bits] bytes: byte 4 j + i of chunk c's vector
    is row j's weight 4 c + i (quant.c's interleave)."""
    G, nb = u.shape[0] // GROUP, u.shape[1]
    v = ((u >> at) & ((1 << bits) - 1) if bits < 8 else u).reshape(G, GROUP, nb, 8, 4)  # [g, j, b, c, i]
    if bits == 8:
        b = v.transpose(0, 2, 3, 1, 4)  # [g, b, c, j, i]
    elif bits == 4:  # vector p: chunk p in the low nibbles, chunk p + 4 in the high ones
        b = (v[:, :, :, :4] | (v[:, :, :, 4:] << 4)).transpose(0, 2, 3, 1, 4)
    elif bits == 2:  # vector h: chunk 4 h + c in bits 2 c, 2 c + 1
        v = v.reshape(G, GROUP, nb, 2, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
        b = np.bitwise_or.reduce(v, axis=4).transpose(0, 2, 3, 1, 4)  # [g, b, h, j, i]
    else:  # one vector: chunk c in bit c
        b = np.bitwise_or.reduce(v << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=3).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(b).reshape(G, nb, 32 * bits)


def _by_group(s: np.ndarray) -> np.ndarray:
    """Per-row scales [8 G, n, *per] -> [G, n, bytes]: for each of the n, the eight rows' values of
    each of the per side by side (``d[8]``, ``sc[16][8]``), as bytes."""
    s = s.reshape(s.shape[0] // GROUP, GROUP, s.shape[1], -1)  # [g, j, n, per]
    return s.transpose(0, 2, 3, 1).copy().view(np.uint8).reshape(s.shape[0], s.shape[2], -1)


def _pad_last(a: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([a, np.zeros((*a.shape[:-1], size - a.shape[-1]), a.dtype)], axis=-1)


def _pack_groups(bt: BlockTensor) -> np.ndarray:
    """bt (rows a multiple of 8) in quant.c's layout: uint8 [G, group bytes]."""
    fmt = bt.format
    q, d, m = bt.fields()  # [R, nb, 32], [R, nb, 1 or 2], None / [R, nb]
    if fmt.name == "mxfp4":  # the stored nibbles (-0 and +0 kept apart) and E8M0 bytes, not their values
        stored = np.ascontiguousarray(bt.blocks).reshape(bt.rows, -1, fmt.block_bytes)
        u, d = np.concatenate([stored[..., 1:] & 0x0F, stored[..., 1:] >> 4], axis=-1), stored[..., 0:1]
    else:
        u = _codes(fmt.name, q)
    quants = np.concatenate([_plane(u, bits, at) for bits, at in _PLANES[fmt.name]], axis=-1)  # [G, nb, bytes]
    G, nb = quants.shape[:2]
    if fmt.k_quant:  # per super-block, the stored scales: d[8], (dmin[8]), sc[..][8 rows], (m[..][8 rows])
        ks = bt.k_scales()
        fields = [ks.d, ks.dmin, ks.sc | (ks.m << 4)] if fmt.name == "q2_k" else [ks.d, ks.dmin, ks.sc, ks.m]
        scales = np.concatenate([_by_group(f) for f in fields if f is not None], axis=-1)
        scales = _pad_last(scales, _UNIT_SCALE_BYTES.get(fmt.name, 160))
        quants = quants.reshape(G, nb // _SUPER_BLOCKS, -1)
    else:  # units of blocks (pairs; MXFP4's four): d[8] (and m[8]) a block; missing last blocks zeros, never read
        unit = _UNIT_BLOCKS.get(fmt.name, 2)
        scales = np.concatenate([_by_group(d)] + ([_by_group(m)] if m is not None else []), axis=-1)
        if nb % unit:
            pad = unit - nb % unit
            scales, quants = (
                np.concatenate([a, np.zeros((G, pad, a.shape[2]), a.dtype)], axis=1) for a in (scales, quants)
            )
        scales, quants = scales.reshape(G, -(-nb // unit), -1), quants.reshape(G, -(-nb // unit), -1)
    return np.concatenate([scales, quants], axis=-1).reshape(G, -1)


Parts = BlockTensor | BlockRows | Sequence[BlockTensor | BlockRows]


def pack(parts: Parts, row_order: np.ndarray | None = None) -> PackedBlocks:
    """``parts`` in ``quant.c``'s layout (:class:`~fastdecode.kernels.abi.PackedBlocks`, 64-byte
    aligned), the last group padded with zero rows. ``parts``: one tensor, or several of one format
    and width stacked by row (a fused projection's), each a :class:`BlockTensor` or its rows in
    another order (:class:`BlockRows`, not moved); ``row_order`` (int64 [rows]): the stack's rows to
    take, in this order (all of them where None). A float tensor (F32 / F16 / BF16) is its rows as
    stored, for the float GEMM (a projection's only part: ``cpu.c`` widens 16-bit weights in
    registers, the bits of the float32 GEMM over :meth:`~fastdecode.kernels.gguf_blocks.BlockTensor.dequantize`'s
    weight).

    The C library's ``fd_pack_blocks`` (``quant_pack.c``) writes it, reading the stored blocks in
    place over the kernel threads; :func:`pack_reference` (numpy) where the library cannot load,
    the same bytes."""
    tensors, order, rows = _stack(parts, row_order)
    if rowgemm_unavailable() is not None:
        return _pack_numpy(tensors, order, rows)
    fmt, cols = tensors[0].format, tensors[0].cols
    lib = _kernel()
    size = lib.fd_pack_bytes(WEIGHT_FORMATS[fmt.name], rows, cols)
    if size < 0:
        raise ValueError(f"{fmt.name}: the C packer does not take {cols} columns")
    data = packed_buffer(size)  # 64-byte aligned, in huge pages where the platform has them
    # the stored rows in place: a row's bytes must be contiguous (a file's, a memory map's always are)
    blocks = [t.blocks if t.blocks.strides[1] == 1 else np.ascontiguousarray(t.blocks) for t in tensors]
    src = np.array([b.ctypes.data for b in blocks], np.uint64)
    src_rows = np.array([b.shape[0] for b in blocks], np.int64)
    src_stride = np.array([b.strides[0] for b in blocks], np.int64)
    code = lib.fd_pack_blocks(
        WEIGHT_FORMATS[fmt.name],
        cols,
        src.ctypes.data,
        src_rows.ctypes.data,
        src_stride.ctypes.data,
        len(blocks),
        None if order is None else order.ctypes.data,
        rows,
        data.data_ptr(),
    )
    if code != 0:
        raise RuntimeError(f"fd_pack_blocks failed ({code}) on {fmt.name} [{rows}, {cols}]")
    return PackedBlocks(fmt.name, rows, cols, data)


def pack_reference(parts: Parts, row_order: np.ndarray | None = None) -> PackedBlocks:
    """:func:`pack` in numpy, a slice of rows at a time (the definition of the layout, and the
    packer where the C library cannot load)."""
    return _pack_numpy(*_stack(parts, row_order))


def _stack(parts: Parts, row_order: np.ndarray | None) -> tuple[list[BlockTensor], np.ndarray | None, int]:
    """(the stored tensors, int64 order of the stack's rows to take or None for all of them, rows out)."""
    items = [parts] if isinstance(parts, (BlockTensor, BlockRows)) else list(parts)
    if not items:
        raise ValueError("pack: no parts")
    tensors = [p.tensor if isinstance(p, BlockRows) else p for p in items]
    first = tensors[0]
    if any(t.format != first.format or t.cols != first.cols for t in tensors):
        raise ValueError("pack: parts differ in format or width")
    total = sum(t.rows for t in tensors)
    order = None
    if any(isinstance(p, BlockRows) for p in items):  # each part's rows, offset to the stack's
        starts = np.cumsum([0] + [t.rows for t in tensors[:-1]])
        order = np.concatenate(
            [s + (p.order if isinstance(p, BlockRows) else np.arange(p.rows)) for s, p in zip(starts, items)]
        ).astype(np.int64)
    if row_order is not None:
        row_order = check_row_order(row_order, total)
        order = row_order if order is None else order[row_order]
    return tensors, order, total if order is None else order.size


def _take(tensors: list[BlockTensor], order: np.ndarray | None, r0: int, r1: int) -> np.ndarray:
    """Rows r0 .. r1 - 1 of the stack under ``order``: uint8 [r1 - r0, row bytes]."""
    if order is None and len(tensors) == 1:
        return np.asarray(tensors[0].blocks[r0:r1])
    index = np.arange(r0, r1) if order is None else order[r0:r1]
    ends = np.cumsum([t.rows for t in tensors])
    which = np.searchsorted(ends, index, side="right")
    out = np.empty((index.size, tensors[0].blocks.shape[1]), np.uint8)
    for p, t in enumerate(tensors):
        sel = which == p
        out[sel] = t.blocks[index[sel] - (ends[p] - t.rows)]
    return out


def _pack_numpy(tensors: list[BlockTensor], order: np.ndarray | None, rows: int) -> PackedBlocks:
    fmt, cols, width = tensors[0].format, tensors[0].cols, tensors[0].blocks.shape[1]
    if rows == 0:
        return PackedBlocks(fmt.name, 0, cols, torch.empty(0, dtype=torch.uint8))
    step = max(GROUP, _CHUNK_WEIGHTS // max(cols, 1) // GROUP * GROUP)  # rows a slice, whole groups
    data, at = None, 0
    for r0 in range(0, rows, step):
        raw = _take(tensors, order, r0, min(r0 + step, rows))
        if fmt.is_float:
            out = np.ascontiguousarray(raw).reshape(-1)
            size = rows * width
        else:
            if raw.shape[0] % GROUP:  # zero rows: the last group's padding (outputs never stored)
                raw = np.concatenate([raw, np.zeros((GROUP - raw.shape[0] % GROUP, width), np.uint8)])
            out = _pack_groups(BlockTensor(fmt, raw, cols)).reshape(-1)
            size = -(-rows // GROUP) * (out.size // (raw.shape[0] // GROUP))
        if data is None:  # torch's CPU allocator aligns to 64 bytes
            data = torch.empty(size, dtype=torch.uint8)
        data[at : at + out.size].copy_(torch.from_numpy(out))
        at += out.size
    return PackedBlocks(fmt.name, rows, cols, data)
