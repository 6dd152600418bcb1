"""The key affine of a cache whose keys are rotated 4-bit blocks (q4_0): calibrated once per
target from the shipped calibration text.

The q4_0 cache stores a key row as the blocks of H k (``kernels/kv.c``), and its keys carry most
of its perplexity loss (docs/benchmarks.md §11). Two exact rewrites of attention help the rounding
(``scripts/kv_key_quant_probe.py`` measured them, keys only, on SmolLM2-135M):

* mu [KV, D], the mean post-RoPE key per (layer, KV head): storing k - mu leaves attention as it
  was, q.(k - mu) = q.k - q.mu, one constant per query, which softmax ignores; the rows are then
  centered and a block's scale spends its range on what differs between tokens;
* s [KV, D] > 0, SmoothAttention's per-channel scale (QServe, Lin et al. 2024) on post-RoPE
  channels, s = (rms(k) / rms(q)) ** ALPHA over the KV head's tokens and its query heads, scaled
  to mean square 1 per (layer, KV head): keys stored as (k - mu) / s meet queries q * s, so
  (q s).((k - mu) / s) = q.k - q.mu; the channels whose keys are large against their queries
  get a finer grid, the others a coarser one.

The affine of a layer is float32 [KV, 3, D] = (mu, 1 / s, s) (``kv.c``'s ``kv_key_affine``). It is
found by one prefill of ``CALIBRATION_TOKENS`` tokens of ``fastdecode.corpora.calibration_text()``
over a float32 cache through the target's own layers (its kernels), reading each layer's queries
and keys; the statistics are float64 numpy reductions of those float32 values, so the same
weights give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastdecode.backends.base import BatchEntry
from fastdecode.corpora import calibration_text
from fastdecode.kv_cache import BlockPool, PagedKVCache

CALIBRATION_TOKENS = 1024  # of the calibration text (fewer where the context is shorter)
CALIBRATION_CHARS = 16_000  # of the text tokenized: comfortably more than CALIBRATION_TOKENS tokens
ALPHA = 0.5  # SmoothAttention's migration strength (QServe's)
BLOCK = 16


def calibration_ids(tokenizer) -> list[int]:
    """The first :data:`CALIBRATION_TOKENS` tokens of the shipped calibration text (special tokens
    as the tokenizer adds them)."""
    return list(tokenizer(calibration_text()[:CALIBRATION_CHARS])["input_ids"])[:CALIBRATION_TOKENS]


class _KeyStatistics:
    """An observer of a pass (``NativeTarget.forward_batch``'s ``observe``): per layer, from the
    pass's queries q [n, H, D] and the keys it wrote [n, KV, D] (positions 0 .. n - 1, blocks in
    order), the layer's affine."""

    def __init__(self, n: int, block_size: int) -> None:
        self.t = torch.arange(n)
        self.block_size = block_size
        self.affines: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return True

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, window, v_pool=None, k_affine=None) -> None:
        keys = k_pool[self.t // self.block_size, :, self.t % self.block_size].float()  # [n, KV, D]
        n, kv, d = keys.shape
        self.affines.append(key_affine(q.float().reshape(n, kv, -1, d).numpy(), keys.numpy()))

    def deliver(self) -> None:
        pass


def key_affine(q: np.ndarray, k: np.ndarray, alpha: float = ALPHA) -> torch.Tensor:
    """One layer's affine, float32 [KV, 3, D] = (mu, 1 / s, s), from its queries q [n, KV, G, D]
    (G query heads per KV head) and keys k [n, KV, D] after RoPE."""
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    mu = k64.mean(axis=0)  # [KV, D]
    rms_k = np.sqrt((k64 * k64).mean(axis=0))
    rms_q = np.sqrt((q64 * q64).mean(axis=(0, 2)))
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (rms_k / rms_q) ** alpha
    s = np.where(np.isfinite(s) & (s > 0), s, 1.0)  # a channel silent in k or q: left as it is
    s = s / np.sqrt((s * s).mean(axis=-1, keepdims=True))
    s32 = s.astype(np.float32)
    affine = np.stack([mu.astype(np.float32), np.float32(1.0) / s32, s32], axis=1)  # [KV, 3, D]
    return torch.from_numpy(np.ascontiguousarray(affine))


@torch.inference_mode()
def calibrate_key_affine(target, token_ids: Sequence[int]) -> list[torch.Tensor]:
    """The affine of each of ``target``'s layers (a ``NativeTarget``) from one prefill of ``token_ids``
    (cut to its context length) over a float32 cache of its own."""
    ids = list(token_ids)[: min(CALIBRATION_TOKENS, target.context_length)]
    blocks = -(-len(ids) // BLOCK)
    shape = (blocks, target.n_kv_heads, BLOCK, target.head_dim)
    k, v = ([torch.empty(shape, dtype=torch.float32) for _ in target.layers] for _ in range(2))
    cache = PagedKVCache(BlockPool(blocks, BLOCK, False), k, v)
    stats = _KeyStatistics(len(ids), BLOCK)
    target.forward_batch(cache, [BatchEntry(ids, 0, list(range(blocks)), 0)], observe=stats)
    return stats.affines
