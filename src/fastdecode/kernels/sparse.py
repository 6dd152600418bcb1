"""2:4 sparse Q8_0 weights in ``sparse.c``'s layout (``s24_q8``): the kept half of a Q8_0
tensor's quants with their 2-bit positions, run by :class:`~fastdecode.kernels.layer.Projection`
like any block format. ``sparse.c`` describes the layout and why its results are the dense
Q8_0 kernel's bit for bit; where the C library does not run, the dense torch reference
(``fastdecode.kernels.quant.block_linear_reference`` over the same Q8_0 blocks) gives those bits.

2:4 sparse float32 weights in ``sparse_f32.c``'s layout (``s24_f32``, :func:`pack_s24_f32`): the
kept half of a float32 tensor with a mask bit a weight, whose products are the dense float32
GEMM's (``fastdecode.kernels.cpu.rowgemm``) over the same weights bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdecode.kernels.abi import GROUP, PackedBlocks
from fastdecode.kernels.gguf_blocks import QK, BlockTensor

S24_FORMAT = "s24_q8"  # kernels.abi.WEIGHT_FORMATS' name
S24_F32_FORMAT = "s24_f32"
CHUNK = 8  # sparse_f32.c's chunk: eight weights (two groups of four), a mask byte and four values
N, M = 2, 4  # two kept of every four


def _kept_positions() -> np.ndarray:
    """The two positions kept of a group of four, by the group's non-zero bits (bit i: weight i):
    its non-zeros, then its first zeros, in increasing order. uint8 [16, 2] (a code with three
    or four bits set never reaches it)."""
    table = np.zeros((16, N), np.uint8)
    for code in range(16):
        nonzero = [i for i in range(M) if code >> i & 1]
        table[code] = sorted((nonzero + [i for i in range(M) if i not in nonzero])[:N])
    return table


_KEPT = _kept_positions()


def is_2_4(q: np.ndarray) -> bool:
    """Whether quants [rows, nb, 32] hold at most two non-zero values in every four."""
    return bool(((q.reshape(*q.shape[:-1], -1, M) != 0).sum(-1) <= N).all())


def sparse_bytes(rows: int, cols: int) -> int:
    """Bytes of the packed tensor (rows padded to groups of eight)."""
    groups, nb = -(-rows // GROUP), -(-cols // QK)
    return groups * (nb // 2 * 352 + nb % 2 * 192)


def pack_s24(bt: BlockTensor) -> PackedBlocks:
    """A Q8_0 tensor whose quants are 2:4 sparse along each row -> ``sparse.c``'s layout.
    Raises ValueError for another format or a group of four with three or four non-zeros."""
    if bt.format.name != "q8_0":
        raise ValueError(f"the 2:4 sparse layout holds q8_0 blocks, not {bt.format.name}")
    q, d, _ = bt.fields()  # [rows, nb, 32] int8, [rows, nb, 1] fp16
    if not is_2_4(q):
        raise ValueError("the weights are not 2:4 sparse (a group of four holds more than two non-zeros)")
    rows, nb = q.shape[:2]
    pad = -rows % GROUP
    G = (rows + pad) // GROUP
    q = np.concatenate([q, np.zeros((pad, nb, QK), np.int8)]) if pad else q
    d = np.concatenate([d, np.zeros((pad, nb, 1), np.float16)]) if pad else d
    groups = q.reshape(G * GROUP, nb, QK // M, M)  # [r, b, group of four, 4]
    code = ((groups != 0) * np.array([1, 2, 4, 8], np.uint8)).sum(-1, dtype=np.uint8)  # which are non-zero
    pos = _KEPT[code]  # [r, b, 8, 2]
    vals = np.take_along_axis(groups, pos.astype(np.int64), axis=-1)  # [r, b, 8, 2]

    def layout(a: np.ndarray) -> np.ndarray:  # [r, b, 8, 2] -> [G, b, v, 32]: byte t = 4 j + s of vector v
        a = a.reshape(G, GROUP, nb, 4, 2, N)  # [g, j, b, v, group 2v / 2v + 1, kept]
        return a.transpose(0, 2, 3, 1, 4, 5).reshape(G, nb, 4, 32)

    t = np.arange(32)
    shifts = (8 * (t % 8) + 2 * (t // 8)).astype(np.uint64)
    words = (layout(pos).astype(np.uint64) << shifts).sum(-1, dtype=np.uint64)  # [G, b, v]: bits disjoint
    blocks = np.concatenate(
        [words.view(np.uint8).reshape(G, nb, 32), layout(vals).view(np.uint8).reshape(G, nb, 128)], -1
    )
    scales = d.reshape(G, GROUP, nb).transpose(0, 2, 1).copy().view(np.uint8).reshape(G, nb, 16)  # d[8] a block
    odd = nb % 2  # units of two blocks: their d[8]s (32 bytes), then their two blocks; an odd last one padded
    scales = np.pad(scales, ((0, 0), (0, odd), (0, 0))).reshape(G, -1, 32)
    blocks = np.pad(blocks, ((0, 0), (0, odd), (0, 0))).reshape(G, -1, 2 * 160)
    units = np.concatenate([scales, blocks], axis=-1).reshape(G, -1)
    data = units[:, : units.shape[1] - 160 * odd].reshape(-1)  # the padding block is never read
    packed = torch.empty(data.size, dtype=torch.uint8)  # torch's CPU allocator aligns to 64 bytes
    packed.copy_(torch.from_numpy(data))
    return PackedBlocks(S24_FORMAT, rows, bt.cols, packed)


def sparse_f32_bytes(rows: int, cols: int) -> int:
    """Bytes of the packed float32 tensor: 68 a row's 32 weights (rows padded to groups of eight)."""
    groups, nc = -(-rows // GROUP), -(-cols // CHUNK)
    return groups * ((nc * 8 + 63) // 64 * 64 + nc * 128)


def pack_s24_f32(w: torch.Tensor) -> PackedBlocks:
    """float32 [rows, cols] with at most two non-zeros in every four inputs (cols % 4 == 0) ->
    ``sparse_f32.c``'s layout. Raises ValueError for another shape or a group of four with three
    or four non-zeros. The kernel's weights are these with +0.0 wherever nothing is kept."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % M:
        raise ValueError(f"the 2:4 sparse float32 layout takes float32 [rows, 4 n], not {w.dtype} {tuple(w.shape)}")
    a = w.detach().contiguous().numpy()
    if not is_2_4(a):
        raise ValueError("the weights are not 2:4 sparse (a group of four holds more than two non-zeros)")
    rows, cols = a.shape
    G, nc = -(-rows // GROUP), -(-cols // CHUNK)
    a = np.pad(a, ((0, G * GROUP - rows), (0, nc * CHUNK - cols)))  # padded rows and tail: nothing kept
    groups = a.reshape(G * GROUP, nc * 2, M)
    pos = _KEPT[((groups != 0) * np.array([1, 2, 4, 8], np.uint8)).sum(-1, dtype=np.uint8)]  # [r, 2 nc, 2]
    vals = np.take_along_axis(groups, pos.astype(np.int64), axis=-1)  # [r, 2 nc, 2]: in increasing position
    bits = (np.uint8(1) << pos).sum(-1, dtype=np.uint8).reshape(-1, nc, 2)  # [r, nc, group 0 / 1]
    codes = bits[..., 0] | (bits[..., 1] << np.uint8(4))  # [r, nc]
    if cols % CHUNK:  # the tail chunk's second group does not exist: nothing kept there
        codes[:, -1] &= 0x0F
        vals.reshape(-1, nc, 4)[:, -1, 2:] = 0
    codes = codes.reshape(G, GROUP, nc).transpose(0, 2, 1).reshape(G, nc * GROUP)  # [g, chunk c: byte j]
    codes = np.pad(codes, ((0, 0), (0, -codes.shape[1] % 64)))
    values = vals.reshape(G, GROUP, nc, 4).transpose(0, 2, 1, 3).reshape(G, -1).view(np.uint8)  # [g, c, j, 4]
    data = np.concatenate([codes, values], axis=-1).reshape(-1)
    packed = torch.empty(data.size, dtype=torch.uint8)  # 64-byte aligned (torch's CPU allocator)
    packed.copy_(torch.from_numpy(data))
    return PackedBlocks(S24_F32_FORMAT, rows, cols, packed)
