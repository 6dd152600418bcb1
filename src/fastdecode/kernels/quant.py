"""Linear layers over ggml's block formats with integer dot products (``quant.c``),
and the pure-torch reference that defines their arithmetic.

Each row of activations is quantized per block of 32 to 8 bits (ggml's Q8_0 /
Q8_1 recipe, scales kept in float32); each weight block meets it in one exact
int32 sum; the blocks' float terms are added in increasing block order, one
output at a time. A row's result depends on that row alone: it is the same in a
1-row decode step, a 16-row verification pass and a 400-row prefill, on one
thread or two, and equal bit for bit across the implementations:

* ``avx512_vnni``: ``quant_avx512.c``'s zmm vpdpbusd kernel, two groups of outputs an instruction (from
  3 rows up; fewer rows stream faster on the ymm loop, which it then takes; Q2_K always takes it);
* ``avx_vnni``: ``quant_ymm.c``'s ymm loop with vpdpbusd;
* ``avx2``: the same loop with vpmaddubsw / vpmaddwd (what a Zen 3 runs);
* ``scalar``: ``quant.c``'s portable C loops, the same packed weights;
* ``torch``: :func:`block_linear_reference`, for machines without the C library.

The library holds every one of them (the VNNI kernels compiled by function attributes); ``auto``
takes the widest this CPU runs (:func:`supported_impls`).

Weights are packed once (:func:`pack`, ``quant_pack.py``) into the kernel's layout
(:class:`PackedBlocks`), groups of eight outputs with their quants interleaved four bytes at a
time and split into bit planes, each pair of blocks (MXFP4: four; a super-block) its scales then its quants:
one stream (``quant.c`` says why); :class:`Projection` (``fastdecode.kernels.layer``, beside the
fused layer that takes it) runs them. Every GGUF block type runs natively, as blocks of 32 with
the scales ggml dequantizes with (``fastdecode.kernels.gguf_types``' table): the super-block formats'
float32 scales formed from their stored ones exactly as ggml forms them, Q2_K, Q3_K and Q6_K
with a scale for each half of a block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastdecode.kernels.abi import GROUP, IMPLS, MAX_PARTS, WEIGHT_FORMATS, CPart, CProj, PackedBlocks
from fastdecode.kernels.abi import I64 as _i64  # noqa: F401 (the declarations' integer type, for their test)
from fastdecode.kernels.abi import QUANT_FUNCTIONS as C_FUNCTIONS
from fastdecode.kernels.cpu import _kernel, rowgemm_unavailable
from fastdecode.kernels.gguf_blocks import QK, BlockTensor
from fastdecode.kernels.layer import Projection
from fastdecode.kernels.quant_pack import pack

__all__ = [
    "C_FUNCTIONS",
    "GROUP",
    "IMPLS",
    "MAX_PARTS",
    "WEIGHT_FORMATS",
    "CPart",
    "CProj",
    "PackedBlocks",
    "Projection",
    "block_linear_reference",
    "kernel_unavailable",
    "pack",
    "quantize_rows",
    "quantize_rows_reference",
    "supported_impls",
]


def kernel_unavailable() -> str | None:
    """None when the C kernels run here, else why not (then :func:`block_linear_reference` serves)."""
    return rowgemm_unavailable()


def supported_impls() -> tuple[str, ...]:
    """The implementations (:data:`IMPLS` but ``auto``) this library and CPU run; () without the C library.
    ``auto`` picks the first of ``avx512_vnni``, ``avx2``, ``scalar`` that runs."""
    if kernel_unavailable() is not None:
        return ()
    lib = _kernel()
    return tuple(name for name, code in IMPLS.items() if name != "auto" and lib.fd_impl_supported(code))


def quantize_rows(
    x: torch.Tensor, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant.c``'s activation quantization: x [M, K] float32 -> (q int8 [M, nb, 32],
    d float32 [M, nb], s int32 [M, nb], sx float32 [M, nb], sxh float32 [M, nb, 2])."""
    lib = _kernel()
    x = x.contiguous()
    M, K = x.shape
    nb = -(-K // QK)
    buf = torch.empty(lib.fd_qact_bytes(M, K), dtype=torch.uint8)
    lib.fd_quantize_rows(x.data_ptr(), M, K, IMPLS[impl], buf.data_ptr())
    q, rest = buf[: M * nb * QK], buf[M * nb * QK :]
    return (
        q.view(torch.int8).view(M, nb, QK),
        rest[: 4 * M * nb].view(torch.float32).view(M, nb),
        rest[4 * M * nb : 8 * M * nb].view(torch.int32).view(M, nb),
        rest[8 * M * nb : 12 * M * nb].view(torch.float32).view(M, nb),
        rest[12 * M * nb :].view(torch.float32).view(M, nb, 2),
    )


# -- the reference ---------------------------------------------------------


def symmetric_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C quantizers' arithmetic over x's last dimension (a block, or a whole row): d = max|x| / 127
    (NaNs skipped), q = round-half-even(x * (1 / d)) clamped to +-127 as float32; 1 / d = 0 where it
    is no finite float (d = 0 or tiny), and a NaN's q = -127, as ``quant.c``'s inv_scale and spans."""
    a = x.abs()
    d = torch.where(a.isnan(), torch.zeros_like(a), a).amax(-1) / 127.0
    inv = 1.0 / d
    inv = torch.where((d != 0) & torch.isfinite(inv), inv, torch.zeros_like(d))
    q = torch.round(x * inv[..., None])
    return torch.where(q.isnan(), torch.full_like(q, -127.0), q).clamp_(-127, 127), d


def quantize_rows_reference(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` in torch: per block of 32 (zero-padded), :func:`symmetric_int8_reference`'s
    d and q, s = sum q, sx = d * s, sxh = d * the sums of q 0..15 and 16..31."""
    M, K = x.shape
    nb = -(-K // QK)
    xb = torch.nn.functional.pad(x.to(torch.float32), (0, nb * QK - K)).view(M, nb, QK)
    q, d = symmetric_int8_reference(xb)
    s = q.sum(-1)  # integers below 2^13: exact
    return q.to(torch.int8), d, s.to(torch.int32), d * s, d[..., None] * q.view(M, nb, 2, QK // 2).sum(-1)


def block_linear_reference(
    x: torch.Tensor, parts: Sequence[BlockTensor], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The block formats' linear layer in torch ops: what the C kernels compute, bit for bit.
    x: [..., in_features]; parts stacked by output; returns float32 [..., out_features]."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    q, dx, _, sx, sxh = quantize_rows_reference(x2)
    qx = q.to(torch.float32).transpose(0, 1)  # [nb, M, 32]
    outs = []
    M, nb = dx.shape
    for part in parts:
        wq, d, m = part.fields()  # [N, nb, 32], [N, nb, S], None / [N, nb] / [N, nb, S]
        S = part.format.scales_per_block  # Q6_K, Q3_K, Q2_K: a scale and a sum for each half of a block
        w = torch.from_numpy(wq.astype(np.float32)) - part.format.q_offset  # Q4_0's q - 8, Q5_0's q - 16
        # Products of integers below 2^8 summed 32 at a time stay below 2^24: float32 sums them exactly.
        ws = w.view(part.rows, nb * S, QK // S).transpose(0, 1)  # [nb S, N, 32 / S]
        xs = qx.view(nb, M, S, QK // S).transpose(1, 2).reshape(nb * S, M, QK // S)
        isum = torch.bmm(xs, ws.transpose(1, 2)).view(nb, S, M, part.rows)
        dw = torch.from_numpy(d.astype(np.float32)).permute(1, 2, 0)  # [nb, S, N]
        mw = None if m is None else torch.from_numpy(m.astype(np.float32)).transpose(0, 1)  # [nb, N(, S)]
        acc = torch.zeros(M, part.rows)
        for b in range(nb):
            term = (dw[b, 0][None] * dx[:, b, None]) * isum[b, 0]
            for h in range(1, S):
                term = term + (dw[b, h][None] * dx[:, b, None]) * isum[b, h]
            if mw is not None and mw.dim() == 3:  # Q2_K: a min for each half, times its half's sum
                for h in range(S):
                    term = term + mw[b, :, h][None] * sxh[:, b, h, None]
            elif mw is not None:
                term = term + mw[b][None] * sx[:, b, None]
            acc = acc + term
        outs.append(acc)
    y = torch.cat(outs, dim=-1)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.view(*lead, y.shape[-1])
