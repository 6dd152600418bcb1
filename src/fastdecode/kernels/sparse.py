"""2:4 sparse Q8_0 weights in ``sparse.c``'s layout (``s24_q8``): the kept half of a Q8_0
tensor's quants with their 2-bit positions, run by :class:`~fastdecode.kernels.layer.Projection`
like any block format. ``sparse.c`` describes the layout and why its results are the dense
Q8_0 kernel's bit for bit; where the C library does not run, the dense torch reference
(``fastdecode.kernels.quant.block_linear_reference`` over the same Q8_0 blocks) gives those bits.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdecode.gguf_blocks import QK, BlockTensor
from fastdecode.kernels.abi import GROUP, PackedBlocks

S24_FORMAT = "s24_q8"  # kernels.abi.WEIGHT_FORMATS' name
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
    return groups * ((nb * 16 + 31) // 32 * 32 + nb * 160)


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
    scales = d.reshape(G, GROUP, nb).transpose(0, 2, 1).copy().view(np.uint8).reshape(G, -1)  # d[8] a block
    scales = np.concatenate([scales, np.zeros((G, -scales.shape[1] % 32), np.uint8)], axis=-1)
    data = np.concatenate([scales, blocks.reshape(G, -1)], axis=-1).reshape(-1)
    packed = torch.empty(data.size, dtype=torch.uint8)  # torch's CPU allocator aligns to 64 bytes
    packed.copy_(torch.from_numpy(data))
    return PackedBlocks(S24_FORMAT, rows, bt.cols, packed)
