"""Weight-only quantization math: round-to-nearest (RTN) and GPTQ.

Pure tensor functions, no modules and no kernel layouts (``linear.py`` owns those).
Terms used throughout, for a weight ``W`` of shape [out, in]:

* **int8 per-channel** (symmetric): one scale per output row;
  ``q = clamp(round(W / scale), -127, 127)`` as int8, ``W ~ q * scale``.
* **int4 group-wise** (asymmetric): each row is cut into groups of
  ``group_size`` consecutive input columns, each group has a scale and a zero;
  ``q`` holds unsigned values 0..15 with mid-point 8, and
  ``W ~ (q - 8) * scale + zero``. This is the convention of torch's int4 kernels
  (``_weight_int4pack_mm*``) and gpt-fast: ``zero = min + 8 * scale``.

Scales and zeros are rounded to bfloat16 (kept in float32 dtype) before the
weights are rounded against them, because the kernels read them in bfloat16:
rounding afterwards would shift every dequantized value by the rounding error.

GPTQ follows Frantar et al. 2022 ("GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers"), Algorithm 1 with lazy block updates and
group-wise parameters chosen as the columns are reached.
"""

from __future__ import annotations

import torch

from fastdecode.errors import ConfigError

INT8_QMAX = 127
INT4_QMAX = 15
INT4_MID = 8
# Group sizes torch's CPU int4 kernel accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
# Floor for a scale, so a constant (or all-zero) group or row does not divide by 0.
_MIN_SCALE = 1e-8


def _round_to_kernel_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------- int8 per-channel


def int8_params(w: torch.Tensor, float32_scales: bool = False) -> torch.Tensor:
    """Per-row symmetric scale of ``w`` [out, in] -> [out] float32: bf16-exact (torch's int8 kernel),
    or with ``float32_scales`` as computed (W8A8: its kernels read float32 scales)."""
    scales = (w.detach().float().abs().amax(dim=1) / INT8_QMAX).clamp(min=_MIN_SCALE)
    return scales if float32_scales else _round_to_kernel_dtype(scales)


def int8_round(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``w`` [out, k] against ``scales`` [out] -> int8 [out, k]."""
    q = torch.round(w.float() / scales.unsqueeze(1))
    return q.clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)


def quantize_int8_per_channel(w: torch.Tensor, float32_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN: ``w`` [out, in] -> (q int8 [out, in], scales float32 [out]), scale = max|w| / 127 of the
    row, rounded to bfloat16 unless ``float32_scales`` (:func:`int8_params`)."""
    _check_2d(w)
    scales = int8_params(w, float32_scales)
    return int8_round(w, scales), scales


def dequantize_int8_per_channel(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q int8 [out, in], scales [out]) -> float32 [out, in]."""
    return q.float() * scales.float().unsqueeze(1)


# ---------------------------------------------------------------- int4 group-wise


def int4_params(w_group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (scale, zero) for each row of ``w_group`` [out, g] -> ([out], [out])."""
    w_group = w_group.detach().float()
    w_min = w_group.amin(dim=1)
    w_max = w_group.amax(dim=1)
    scale = _round_to_kernel_dtype(((w_max - w_min) / INT4_QMAX).clamp(min=_MIN_SCALE))
    zero = _round_to_kernel_dtype(w_min + INT4_MID * scale)
    return scale, zero


def int4_round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``w`` [out, k] against one (scale, zero) per row, each [out] -> uint8 0..15 [out, k]."""
    q = torch.round((w.float() - zero.unsqueeze(1)) / scale.unsqueeze(1)) + INT4_MID
    return q.clamp_(0, INT4_QMAX).to(torch.uint8)


def quantize_int4_groupwise(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RTN: ``w`` [out, in] -> (q uint8 0..15 [out, in], scales [out, in/g], zeros [out, in/g])."""
    _check_2d(w)
    check_group_size(w.shape[1], group_size)
    out_features, in_features = w.shape
    groups = w.detach().float().reshape(out_features * in_features // group_size, group_size)
    scales, zeros = int4_params(groups)  # [out * in/g] each
    q = int4_round(groups, scales, zeros).reshape(out_features, in_features)
    return q, scales.reshape(out_features, -1), zeros.reshape(out_features, -1)


def dequantize_int4_groupwise(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(q [out, in], scales [out, in/g], zeros [out, in/g]) -> float32 [out, in]."""
    scales = scales.float().repeat_interleave(group_size, dim=1)  # [out, in]
    zeros = zeros.float().repeat_interleave(group_size, dim=1)
    return (q.float() - INT4_MID) * scales + zeros


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {INT4_GROUP_SIZES} (torch's int4 kernel), got {group_size}")
    if in_features % group_size:
        raise ConfigError(f"int4 group size {group_size} does not divide in_features={in_features}")


def _check_2d(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ConfigError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")


# ---------------------------------------------------------------- GPTQ


def gptq_hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X X^T / n for calibration inputs ``x`` [..., in] -> float32 [in, in].

    With X laid out [in, n] (one column per token) as in the paper; the 1/n keeps
    the damping term ``percdamp * mean(diag H)`` independent of the token count.
    Accumulate over batches with :class:`HessianAccumulator`.
    """
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.H


class HessianAccumulator:
    """Running H = 2/n * sum_t x_t x_t^T over every token seen so far."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.num_tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # [n_new, in]
        n_new = x.shape[0]
        if n_new == 0:
            return
        total = self.num_tokens + n_new
        self.H.mul_(self.num_tokens / total)
        x = x * (2.0 / total) ** 0.5
        self.H.addmm_(x.T, x)
        self.num_tokens = total


def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int | None = 32,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> tuple[torch.Tensor, ...]:
    """GPTQ-quantize ``w`` [out, in] given the layer's Hessian ``H`` [in, in].

    Returns exactly what the RTN function of the same scheme returns:
    ``bits=4`` -> :func:`quantize_int4_groupwise`'s (q, scales, zeros);
    ``bits=8`` -> :func:`quantize_int8_per_channel`'s (q, scales) (``group_size``
    must be None: int8 is per-channel).

    Columns are quantized left to right; each one's rounding error, scaled by the
    inverse Hessian, is pushed onto the columns not yet quantized (Cholesky form
    of H^-1, as in the paper). Updates inside a block of ``blocksize`` columns are
    applied eagerly, the rest once per block ("lazy batch updates"). For int4 a
    group's (scale, zero) is chosen when its first column is reached, from the
    group's columns as already updated by the errors of earlier columns.
    """
    _check_2d(w)
    out_features, in_features = w.shape
    blocksize = _gptq_blocksize(w, H, bits, group_size, blocksize, percdamp)
    W, Hinv = _gptq_prepare(w, H, percdamp)  # [out, in] updated in place as errors are pushed right; [in, in]

    zeros = None
    if bits == 8:
        scales = int8_params(W)  # [out]
        Q = torch.zeros(out_features, in_features, dtype=torch.int8)
    else:
        n_groups = in_features // group_size
        scales = torch.zeros(out_features, n_groups)
        zeros = torch.zeros(out_features, n_groups)
        Q = torch.zeros(out_features, in_features, dtype=torch.uint8)

    for i1 in range(0, in_features, blocksize):
        i2 = min(i1 + blocksize, in_features)
        Err1 = _gptq_block(W, Hinv, Q, scales, zeros, i1, i2, group_size)  # [out, b]
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if bits == 8:
        return Q, scales
    return Q, scales, zeros


def _gptq_blocksize(
    w: torch.Tensor, H: torch.Tensor, bits: int, group_size: int | None, blocksize: int, percdamp: float
) -> int:
    """Checks :func:`gptq_quantize`'s arguments; returns the block size to use."""
    in_features = w.shape[1]
    if H.shape != (in_features, in_features):
        raise ConfigError(f"Hessian shape {tuple(H.shape)} does not match weight {tuple(w.shape)}")
    if bits == 4:
        if group_size is None:
            raise ConfigError("int4 GPTQ needs a group size")
        check_group_size(in_features, group_size)
        # Whole groups per block, so a group's columns are all in the eagerly updated block.
        blocksize = max(group_size, blocksize // group_size * group_size)
    elif bits == 8:
        if group_size is not None:
            raise ConfigError("int8 is per-channel: group_size must be None")
    else:
        raise ConfigError(f"GPTQ supports bits=4 or bits=8, got {bits}")
    if percdamp < 0:
        raise ConfigError(f"percdamp must be >= 0, got {percdamp}")
    return blocksize


def _gptq_prepare(w: torch.Tensor, H: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, Hinv): float copies of ``w`` [out, in] with dead inputs zeroed, and the upper
    Cholesky factor of the damped H^-1 [in, in]."""
    W = w.detach().float().clone()  # [out, in]
    H = H.detach().float().clone()  # [in, in]
    dead = torch.diag(H) == 0  # inputs never active: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    damp = percdamp * torch.mean(torch.diag(H))
    H.diagonal().add_(damp)
    return W, _upper_cholesky_of_inverse(H)  # Hinv upper triangular


def _gptq_block(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    Q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    i1: int,
    i2: int,
    group_size: int | None,
) -> torch.Tensor:
    """Quantize columns i1 .. i2 - 1 into ``Q`` (int8 per-channel when ``zeros`` is None,
    else int4 groups, whose ``scales`` and ``zeros`` are set as each group is reached),
    each column's error pushed onto the block's later columns; returns the block's
    scaled errors Err1 [out, i2 - i1] for the columns after it."""
    W1 = W[:, i1:i2].clone()  # [out, b]
    Err1 = torch.zeros_like(W1)  # [out, b]
    Hinv1 = Hinv[i1:i2, i1:i2]  # [b, b]
    for i in range(i2 - i1):
        col = i1 + i
        w_col = W1[:, i]  # [out]
        if zeros is None:
            q_col = int8_round(w_col.unsqueeze(1), scales).squeeze(1)
            deq = q_col.float() * scales
        else:
            g = col // group_size
            if col % group_size == 0:
                scales[:, g], zeros[:, g] = int4_params(W1[:, i : i + group_size])
            q_col = int4_round(w_col.unsqueeze(1), scales[:, g], zeros[:, g]).squeeze(1)
            deq = (q_col.float() - INT4_MID) * scales[:, g] + zeros[:, g]
        Q[:, col] = q_col
        err = (w_col - deq) / Hinv1[i, i]  # [out]
        W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
        Err1[:, i] = err
    return Err1


def _upper_cholesky_of_inverse(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H^-1; retries with more damping if H is not positive definite."""
    eye_scale = torch.mean(torch.diag(H)).clamp(min=1e-8)
    for attempt in range(5):
        L, info = torch.linalg.cholesky_ex(H)
        if info.item() == 0:
            Hinv = torch.cholesky_inverse(L)
            return torch.linalg.cholesky(Hinv, upper=True)
        # Numerically singular (e.g. fewer calibration tokens than inputs): damp harder.
        H = H + torch.eye(H.shape[0], dtype=H.dtype, device=H.device) * eye_scale * 0.1 * 10**attempt
    raise ConfigError("GPTQ: the calibration Hessian is not positive definite even after damping")
