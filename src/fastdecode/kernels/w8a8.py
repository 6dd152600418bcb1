"""W8A8 weights in ``w8a8.c``'s layout: int8 with one float32 scale per output channel, run by
:class:`~fastdecode.kernels.layer.Projection` like any block format, against activations
quantized per token (one scale a row); and the torch reference that defines their arithmetic.

    y[m, n] = (dw[n] * dx[m]) * (float)isum[m, n],   isum = the exact int32 sum of qw[n, :] * qx[m, :]

``w8a8.c`` says why every implementation (AVX-512 VNNI, AVX-VNNI, AVX2, scalar) gives the same
bits and why a row's result does not depend on the rows beside it; :func:`w8a8_linear_reference`
gives those bits in torch ops where the C library does not run.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdecode.errors import ConfigError
from fastdecode.kernels.abi import GROUP, IMPLS, PackedBlocks
from fastdecode.kernels.gguf_blocks import QK
from fastdecode.kernels.library import kernel as _kernel
from fastdecode.kernels.quant import symmetric_int8_reference

W8A8_FORMAT = "w8a8"  # kernels.abi.WEIGHT_FORMATS' name
_SCALE_BYTES = 32  # w8a8.c's W8A8_SCALE_BYTES: a group's dw[8]
# The widest input whose int32 sums (|sum| <= K * 128 * 127, and 128 * sx) stay exact: 132,104.
MAX_INPUTS = (2**31 - 1) // (128 * 127)


def padded_inputs(cols: int) -> int:
    """``w8a8.c``'s kp: the input dimension padded to a multiple of 32."""
    return -(-cols // QK) * QK


def w8a8_bytes(rows: int, cols: int) -> int:
    """Bytes of the packed tensor (rows padded to groups of eight, inputs to a multiple of 32)."""
    return -(-rows // GROUP) * (_SCALE_BYTES + GROUP * padded_inputs(cols))


def pack_w8a8(q: torch.Tensor, scales: torch.Tensor) -> PackedBlocks:
    """int8 weights q [rows, cols] and float32 scales [rows] -> ``w8a8.c``'s layout."""
    if q.dtype != torch.int8 or q.dim() != 2 or scales.shape != (q.shape[0],):
        raise ValueError(f"W8A8 weights are int8 [rows, cols] with scales [rows]; got {q.dtype} {tuple(q.shape)}")
    rows, cols = q.shape
    if padded_inputs(cols) > MAX_INPUTS:
        raise ConfigError(
            f"W8A8 takes at most {MAX_INPUTS // QK * QK} inputs a layer (its int32 sums must stay exact); got {cols}"
        )
    kp, pad = padded_inputs(cols), -rows % GROUP
    G = (rows + pad) // GROUP
    w = np.zeros((G * GROUP, kp), np.int8)
    w[:rows, :cols] = q.numpy()
    d = np.zeros(G * GROUP, np.float32)
    d[:rows] = scales.detach().to(torch.float32).numpy()
    quants = w.reshape(G, GROUP, kp // 4, 4).transpose(0, 2, 1, 3).reshape(G, -1).view(np.uint8)  # chunk c: row j's 4
    groups = np.concatenate([d.reshape(G, GROUP).view(np.uint8), quants], axis=1).reshape(-1)
    data = torch.empty(groups.size, dtype=torch.uint8)  # torch's CPU allocator aligns to 64 bytes
    data.copy_(torch.from_numpy(groups))
    return PackedBlocks(W8A8_FORMAT, rows, cols, data)


def quantize_tokens(x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w8a8.c``'s activation quantization: x [M, K] float32 -> (q int8 [M, kp] (zeros past K),
    d float32 [M], s int32 [M] (each row's sum of q))."""
    lib = _kernel()
    x = x.contiguous()
    M, K = x.shape
    kp = padded_inputs(K)
    buf = torch.empty(lib.fd_w8a8_act_bytes(M, K), dtype=torch.uint8)
    lib.fd_w8a8_quantize_rows(x.data_ptr(), M, K, IMPLS[impl], buf.data_ptr())
    return (
        buf[: M * kp].view(torch.int8).view(M, kp),
        buf[M * kp : M * kp + 4 * M].view(torch.float32),
        buf[M * kp + 4 * M :].view(torch.int32),
    )


# -- the reference ---------------------------------------------------------


def quantize_tokens_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [M, K] -> (q int8 [M, K], d float32 [M]); the block formats'
    quantizer (``quant.symmetric_int8_reference``) with the block a whole row."""
    q, d = symmetric_int8_reference(x.to(torch.float32))
    return q.to(torch.int8), d


def w8a8_linear_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The W8A8 linear layer in torch ops: what the C kernels compute, bit for bit.
    x: [..., K]; q: int8 [N, K]; scales: float32 [N]; returns float32 [..., N]."""
    lead, K = x.shape[:-1], x.shape[-1]
    qx, dx = quantize_tokens_reference(x.reshape(-1, K))
    # Products below 2^14 summed in float64 stay exact (below 2^53), then the int32 the kernel holds.
    isum = (qx.to(torch.float64) @ q.to(torch.float64).T).to(torch.int64).to(torch.int32)  # [M, N]
    t = scales.to(torch.float32)[None, :] * dx[:, None]  # dw * dx, float32
    y = t * isum.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.view(*lead, q.shape[0])
