"""Pruning math: masks, the magnitude and Wanda scores, and SparseGPT's reconstruction.

Pure tensor functions, no modules (``pruning.py`` owns the method and its calibration).
Terms, for a weight ``W`` of shape [out, in] and a layer input ``X`` [tokens, in]:

* a **mask** is a bool tensor shaped like ``W``, True where a weight is **kept**;
* **unstructured** sparsity s prunes exactly ``round(s * numel)`` weights of the layer
  (per row: ``round(s * in)`` weights of each output row, as Wanda compares);
* **N:M** keeps exactly N of every M consecutive weights of a row along the input
  dimension (2:4 is NVIDIA's pattern: two kept of every four); ``in`` must be a multiple of M;
* the **magnitude** score is |W|; **Wanda**'s (Sun et al. 2023, "A Simple and Effective
  Pruning Approach for Large Language Models") is |W_ij| * ||X_j||_2, the weight times the
  l2 norm of its input channel over the calibration tokens, compared within each output row;
* **SparseGPT** (Frantar & Alistarh 2023, "SparseGPT: Massive Language Models Can Be
  Accurately Pruned in One-Shot"): the columns are visited left to right in blocks of
  ``blocksize``; a block's mask is chosen by the OBS saliency w^2 / [H^-1]_jj^2 (H = 2 X^T X / n,
  the GPTQ Hessian), each pruned (or, jointly, rounded) weight's error is pushed onto the
  columns not yet visited through the Cholesky factor of H^-1, as GPTQ does with rounding
  errors (``fastdecode.quant.math``). For N:M the mask of each M columns is chosen when
  the first of them is reached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdecode.errors import ConfigError
from fastdecode.quant.math import _gptq_prepare

# (column [out] pruned, the columns from it on [out, rest] as updated so far, its index in the
# layer) -> the column rounded to the output format [out] (joint quantization)
ColumnRounding = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def check_pattern(n: int, m: int) -> None:
    if not 0 < n < m:
        raise ConfigError(f"an N:M pattern keeps N of every M weights, 0 < N < M; got {n}:{m}")


def parse_pattern(text: str) -> tuple[int, int]:
    """ "2:4" -> (2, 4)."""
    try:
        n, m = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError(f"an N:M pattern is two integers like 2:4, got {text!r}") from None
    check_pattern(n, m)
    return n, m


def nm_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest-scoring of every ``m`` consecutive inputs of each row.
    score: [out, in] (in % m == 0) -> bool [out, in]."""
    check_pattern(n, m)
    out_features, in_features = score.shape
    if in_features % m:
        raise ConfigError(f"an {n}:{m} pattern needs in_features divisible by {m}, got {in_features}")
    groups = score.reshape(out_features, in_features // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.reshape(out_features, in_features)


def unstructured_mask(score: torch.Tensor, sparsity: float, per_row: bool = False) -> torch.Tensor:
    """Prune exactly ``round(sparsity * numel)`` lowest-scoring weights of the layer, or with
    ``per_row`` ``round(sparsity * in)`` of each row (ties broken by position). -> bool keep mask."""
    check_sparsity(sparsity)
    flat = score.reshape(score.shape[0], -1) if per_row else score.reshape(1, -1)
    pruned = round(sparsity * flat.shape[1])
    keep = torch.ones_like(flat, dtype=torch.bool)
    if pruned:
        keep.scatter_(1, flat.topk(pruned, dim=1, largest=False).indices, False)
    return keep.reshape(score.shape)


def check_sparsity(sparsity: float) -> None:
    if not 0 <= sparsity < 1:
        raise ConfigError(f"sparsity is the fraction of weights pruned, in [0, 1); got {sparsity}")


def magnitude_score(w: torch.Tensor) -> torch.Tensor:
    return w.detach().float().abs()


def wanda_score(w: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2. w: [out, in]; x_norm: [in] -> [out, in]."""
    return w.detach().float().abs() * x_norm.float().reshape(1, -1)


def score_mask(
    score: torch.Tensor, sparsity: float | None, pattern: tuple[int, int] | None, per_row: bool
) -> torch.Tensor:
    """The keep mask of an N:M ``pattern``, else of unstructured ``sparsity``."""
    if pattern is not None:
        return nm_mask(score, *pattern)
    return unstructured_mask(score, sparsity, per_row=per_row)


def sparsegpt_prune(
    w: torch.Tensor,
    H: torch.Tensor,
    *,
    sparsity: float | None = None,
    pattern: tuple[int, int] | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    rounding: ColumnRounding | None = None,
) -> torch.Tensor:
    """SparseGPT: ``w`` [out, in] pruned to ``sparsity`` (unstructured, exact per layer) or to
    an N:M ``pattern``, the rest updated to reconstruct the layer's output on the inputs whose
    Hessian is ``H`` [in, in]. ``rounding`` (joint quantization, as the paper's 3.2): called on
    each column block as it is reached, returns the columns rounded to the output format; the
    pruned weights stay exactly 0. Returns the new float32 weight [out, in]."""
    if (sparsity is None) == (pattern is None):
        raise ConfigError("SparseGPT takes a sparsity or an N:M pattern, not both or neither")
    if pattern is not None:
        check_pattern(*pattern)
        if blocksize % pattern[1] or w.shape[1] % pattern[1]:
            raise ConfigError(f"an {pattern[0]}:{pattern[1]} pattern needs in_features and blocksize divisible by M")
    else:
        check_sparsity(sparsity)
    if H.shape != (w.shape[1], w.shape[1]):
        raise ConfigError(f"Hessian shape {tuple(H.shape)} does not match weight {tuple(w.shape)}")
    W, Hinv = _gptq_prepare(w, H, percdamp)  # [out, in] updated in place; upper Cholesky factor of H^-1
    out_features, in_features = W.shape
    for i1 in range(0, in_features, blocksize):
        i2 = min(i1 + blocksize, in_features)
        keep = None
        if sparsity is not None:  # exact over the layer: each block prunes its share of the running total
            before, after = round(sparsity * out_features * i1), round(sparsity * out_features * i2)
            keep = _block_mask(W[:, i1:i2], Hinv[i1:i2, i1:i2], after - before)
        Err1 = _sparsegpt_block(W, Hinv, i1, i2, keep, pattern, rounding)
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return W


def _block_mask(W1: torch.Tensor, Hinv1: torch.Tensor, pruned: int) -> torch.Tensor:
    """Keep mask of a column block pruning its ``pruned`` lowest w^2 / [H^-1]_jj^2 weights."""
    saliency = W1.pow(2) / Hinv1.diagonal().reshape(1, -1).pow(2)
    keep = torch.ones_like(W1, dtype=torch.bool).reshape(-1)
    if pruned:
        keep[saliency.reshape(-1).topk(pruned, largest=False).indices] = False
    return keep.reshape(W1.shape)


def _sparsegpt_block(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    i1: int,
    i2: int,
    keep: torch.Tensor | None,
    pattern: tuple[int, int] | None,
    rounding: ColumnRounding | None,
) -> torch.Tensor:
    """Prune (and round) columns i1 .. i2 - 1 of ``W`` in place, each column's error pushed onto
    the block's later columns; returns the block's scaled errors Err1 [out, i2 - i1]."""
    W1 = W[:, i1:i2].clone()  # [out, b]
    Err1 = torch.zeros_like(W1)
    Hinv1 = Hinv[i1:i2, i1:i2]  # [b, b]
    if keep is None:
        keep = torch.ones_like(W1, dtype=torch.bool)
    for i in range(i2 - i1):
        if pattern is not None and i % pattern[1] == 0:
            n, m = pattern
            saliency = W1[:, i : i + m].pow(2) / Hinv1.diagonal()[i : i + m].reshape(1, -1).pow(2)
            keep[:, i : i + m] = nm_mask(saliency, n, m)
        w_col = W1[:, i].clone()
        q_col = torch.where(keep[:, i], w_col, torch.zeros_like(w_col))
        if rounding is not None:  # the format's rounding, its block scales set as each block is reached
            q_col = rounding(q_col, W1[:, i:], i1 + i)
        err = (w_col - q_col) / Hinv1[i, i]
        W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
        W1[:, i] = q_col
        Err1[:, i] = err
    W[:, i1:i2] = W1
    return Err1
