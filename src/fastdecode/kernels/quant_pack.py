"""A block tensor in ``quant.c``'s layout (:func:`pack`): groups of eight outputs, each group its
blocks in units (a pair of blocks, or a super-block), a unit its scales then its quants, the eight
rows' quants interleaved four weights at a time and split into bit planes (``quant.c``'s comment
gives the layout byte by byte).

Bytes a weight once packed (whole groups of eight rows; a pair format's odd last block padded):
Q8_0 1.0625, Q4_0 and IQ4_NL 0.5625, Q4_1 0.625, Q5_0 0.6875, Q5_1 0.75, Q2_K 0.328, Q3_K 0.453,
Q4_K 0.578, Q5_K 0.703, Q6_K 0.828, IQ4_XS 0.547: the file's bits, the super-block formats' scales
padded to a multiple of 32 bytes (``fastdecode.kernels.gguf_types.GGUF_TYPES`` has both figures).

Packing goes a slice of rows at a time, so a tensor's temporaries stay a few tens of MB whatever
its size (an 8B model's LM head is half a billion weights).
"""

from __future__ import annotations

import numpy as np
import torch

from fastdecode.kernels.abi import GROUP, PackedBlocks
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.kernels.gguf_types import IQ4_VALUES

# A format's quants as quant.c stores them: its planes, each (bits, at): a plane of bits-wide fields
# holding bits at .. at + bits - 1 of each weight's code u, in this order; u = q + _CODE_BIAS (IQ4:
# the index of q's level).
_PLANES: dict[str, tuple[tuple[int, int], ...]] = {
    "q8_0": ((8, 0),),
    **dict.fromkeys(("q4_0", "q4_1", "q4_k", "iq4_nl", "iq4_xs"), ((4, 0),)),
    **dict.fromkeys(("q5_0", "q5_1", "q5_k"), ((4, 0), (1, 4))),
    "q6_k": ((4, 0), (2, 4)),
    "q3_k": ((2, 0), (1, 2)),
    "q2_k": ((2, 0),),
}
_CODE_BIAS = {"q6_k": 32, "q3_k": 4}
_SUPER_BLOCKS = 8  # blocks of 32 a super-block: quant.c's unit for the super-block formats
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
    u = _codes(fmt.name, q)
    quants = np.concatenate([_plane(u, bits, at) for bits, at in _PLANES[fmt.name]], axis=-1)  # [G, nb, bytes]
    G, nb = quants.shape[:2]
    if fmt.k_quant:  # per super-block, the stored scales: d[8], (dmin[8]), sc[..][8 rows], (m[..][8 rows])
        ks = bt.k_scales()
        fields = [ks.d, ks.dmin, ks.sc | (ks.m << 4)] if fmt.name == "q2_k" else [ks.d, ks.dmin, ks.sc, ks.m]
        scales = np.concatenate([_by_group(f) for f in fields if f is not None], axis=-1)
        scales = _pad_last(scales, _UNIT_SCALE_BYTES.get(fmt.name, 160))
        quants = quants.reshape(G, nb // _SUPER_BLOCKS, -1)
    else:  # pairs of blocks: d[8] (and m[8]) fp16 a block; an odd last block padded with zeros, never read
        scales = np.concatenate([_by_group(d)] + ([_by_group(m)] if m is not None else []), axis=-1)
        if nb % 2:
            scales, quants = (np.concatenate([a, np.zeros_like(a[:, :1])], axis=1) for a in (scales, quants))
        scales, quants = scales.reshape(G, -(-nb // 2), -1), quants.reshape(G, -(-nb // 2), -1)
    return np.concatenate([scales, quants], axis=-1).reshape(G, -1)


def pack(bt: BlockTensor) -> PackedBlocks:
    """``bt`` in ``quant.c``'s layout (:class:`~fastdecode.kernels.abi.PackedBlocks`, 64-byte aligned),
    the last group padded with zero rows. A float tensor (F32 / F16 / BF16) is its rows as stored, for
    the float GEMM (a projection's only part: ``cpu.c`` widens 16-bit weights in registers, the bits
    of the float32 GEMM over :meth:`~fastdecode.kernels.gguf_blocks.BlockTensor.dequantize`'s weight)."""
    fmt = bt.format
    if fmt.is_float:
        data = torch.empty(bt.blocks.size, dtype=torch.uint8)  # torch's CPU allocator aligns to 64 bytes
        data.copy_(torch.from_numpy(np.ascontiguousarray(bt.blocks).reshape(-1)))
        return PackedBlocks(fmt.name, bt.rows, bt.cols, data)
    rows, width = bt.rows, bt.blocks.shape[1]
    if rows == 0:
        return PackedBlocks(fmt.name, 0, bt.cols, torch.empty(0, dtype=torch.uint8))
    step = max(GROUP, _CHUNK_WEIGHTS // max(bt.cols, 1) // GROUP * GROUP)  # rows a slice, whole groups
    data, at = None, 0
    for r0 in range(0, rows, step):
        raw = np.asarray(bt.blocks[r0 : r0 + step])
        if raw.shape[0] % GROUP:  # zero rows: the last group's padding (outputs never stored)
            raw = np.concatenate([raw, np.zeros((GROUP - raw.shape[0] % GROUP, width), np.uint8)])
        groups = _pack_groups(BlockTensor(fmt, raw, bt.cols)).reshape(-1)
        if data is None:  # torch's CPU allocator aligns to 64 bytes
            data = torch.empty(-(-rows // GROUP) * (groups.size // (raw.shape[0] // GROUP)), dtype=torch.uint8)
        data[at : at + groups.size].copy_(torch.from_numpy(groups))
        at += groups.size
    return PackedBlocks(fmt.name, rows, bt.cols, data)
