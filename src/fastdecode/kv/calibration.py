"""The key affine of a cache whose keys are rotated 4-bit blocks (q4_0): calibrated once per
target from the shipped calibration text.

The q4_0 cache stores a key row as the blocks of H k (``kernels/kv.c``), and its keys carry most
of its perplexity loss (docs/benchmarks.md §11). Two exact rewrites of attention help the rounding
(a probe since removed, docs/benchmarks.md §5.2, measured them, keys only, on SmolLM2-135M):

* mu [KV, D], the mean post-RoPE key per (layer, KV head): storing k - mu leaves attention as it
  was, q.(k - mu) = q.k - q.mu, one constant per query, which softmax ignores; the rows are then
  centered and a block's scale spends its range on what differs between tokens;
* s [KV, D] > 0, SmoothAttention's per-channel scale (QServe, Lin et al. 2024) on post-RoPE
  channels, s = (rms(k) / rms(q)) ** ALPHA over the KV head's tokens and its query heads, scaled
  to mean square 1 per (layer, KV head): keys stored as (k - mu) / s meet queries q * s, so
  (q s).((k - mu) / s) = q.k - q.mu; the channels whose keys are large against their queries
  get a finer grid, the others a coarser one.

And one change of the rounding itself, not of attention:

* F [KV, D, D], GPTQ's error feedback (Frantar et al. 2022) along each stored row: the row's
  elements are rounded in order and each one's error is taken off the later ones
  (``kv.c``'s ``kv_store_blocks``), F fitted to the second moment of the queries that meet
  the row in its stored domain (:func:`query_moment`, :func:`error_feedback`). A score's error is
  q.e, so the error worth leaving is the one the queries see least, e^T E[q q^T] e, not the
  smallest e; the rounding stays ggml's q4_0 blocks (the same bytes a row, read by the same
  kernel). This took WikiText-2's 4,096-token q4_0 perplexity from +3.59% to +1.22% of the float32
  cache's (KL 0.0333 -> 0.0197; docs/benchmarks.md §20), where a least-squares block scale, which
  lowers the plain error, had raised it.

The statistics are read at the calibration's positions and must hold at every position a cache
holds, so each is taken in a form RoPE does not change: s from a RoPE pair's two channels together
(QServe ties them too), mu from the keys before RoPE, turned into the mean over the positions a cache
holds (:func:`key_affine`, :data:`MU_POSITIONS`); the queries' moment the same way as mu. The keys' own means and per-channel scales,
measured at 1,024 positions, made a 4,096-token context worse than no affine.

The affine of a layer is float32 [KV, 3 + D, D] = (mu, 1 / s, s, F) (``kv.c``'s ``kv_key_affine``). It is
found by one prefill of ``CALIBRATION_TOKENS`` tokens of ``fastdecode.data.corpora.calibration_text()``
over a float32 cache through the target's own layers (its kernels), reading each layer's queries
and keys; the statistics are float64 numpy reductions of those float32 values, so the same
weights give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fastdecode.data.corpora import calibration_text
from fastdecode.kernels.kv_formats import hadamard
from fastdecode.kv.cache import BatchEntry, BlockPool, PagedKVCache

CALIBRATION_TOKENS = 1024  # of the calibration text (fewer where the context is shorter)
CALIBRATION_CHARS = 16_000  # of the text tokenized: comfortably more than CALIBRATION_TOKENS tokens
# On a development text apart from the evaluation text (a probe since removed: 4,096 tokens of Tiny
# Shakespeare after the calibration's, SmolLM2-135M gguf weights), KL against the float32 cache: no affine
# 0.0393; the keys' own mean over the 1,024 calibration positions with per-channel s 0.0457 (worse: past 1,024
# positions both are off), with s per RoPE pair 0.0338; mu over 8,192 positions (s per pair) 0.0344, over
# 4,096 0.0305; then s's strength ALPHA 0.75 / 0.5 / 0.25 / 0: 0.0338 / 0.0305 / 0.0304 / 0.0293. On the
# WikiText-2 4,096-token window (the figure), ALPHA 0.5 / 0: KL 0.0333 / 0.0374 (no affine 0.0407):
# s is worth little on the one text and some on the other; kept at QServe's 0.5.
ALPHA = 0.5  # SmoothAttention's migration strength (QServe's)
MU_POSITIONS = 4096  # mu for a cache of positions 0 .. MU_POSITIONS - 1 (at most the context; None: all of it)
BLOCK = 16


def calibration_ids(tokenizer) -> list[int]:
    """The first :data:`CALIBRATION_TOKENS` tokens of the shipped calibration text (special tokens
    as the tokenizer adds them)."""
    return list(tokenizer(calibration_text()[:CALIBRATION_CHARS])["input_ids"])[:CALIBRATION_TOKENS]


class _KeyStatistics:
    """An observer of a pass (``NativeTarget.forward_batch``'s ``observe``): per layer, from the
    pass's queries q [n, H, D] and the keys it wrote [n, KV, D] (positions 0 .. n - 1, blocks in
    order), the layer's affine. ``rope``: per layer, :func:`rope_means`' tables."""

    def __init__(self, n: int, block_size: int, rope: list[tuple[np.ndarray, ...]], **keywords) -> None:
        self.t = torch.arange(n)
        self.block_size = block_size
        self.rope, self.keywords = rope, keywords
        self.affines: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return True

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, window, v_pool=None, k_affine=None) -> None:
        keys = k_pool[self.t // self.block_size, :, self.t % self.block_size].float()  # [n, KV, D]
        n, kv, d = keys.shape
        rope = self.rope[len(self.affines)]
        q = q.float().reshape(n, kv, -1, d).numpy()
        self.affines.append(key_affine(q, keys.numpy(), rope, **self.keywords))

    def deliver(self) -> None:
        pass


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _before_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, ..., D] after RoPE at positions 0 .. n - 1 (cos, sin [n, D]) rotated back: R(-p) x."""
    lead = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
    return x * cos.reshape(lead) - _rotate_half(x) * sin.reshape(lead)


def key_affine(
    q: np.ndarray, k: np.ndarray, rope=None, alpha: float = ALPHA, tie_pairs: bool = True, feedback: bool = True
) -> torch.Tensor:
    """One layer's affine, float32 [KV, 3 + D, D] = (mu, 1 / s, s, F), from its queries q [n, KV, G, D]
    (G query heads per KV head) and keys k [n, KV, D] after RoPE at positions 0 .. n - 1.

    mu: with ``rope`` (:func:`rope_means`' seven tables: cos, sin [n, D] of the positions, their
    means [D] over the context and the means of their outer products), the keys' mean before RoPE,
    m (each key rotated back by its position), turned into the mean of R(p) m over every position p
    of the context - the constant nearest the keys a
    cache of the whole context holds, where the keys' own mean holds only for the calibration's
    positions (a channel pair RoPE turns by a radian over 1,024 positions turns past its mean by
    4,096); without, the keys' mean. s: SmoothAttention's, over a RoPE pair's two channels together
    (``tie_pairs``: RoPE moves energy between them; their sum is the same at every position). F: the
    rounding's error feedback for rows stored rotated (:func:`error_feedback`, over the queries'
    moment at every position of the context, as mu; ``feedback`` False: zeros, plain rounding)."""
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    if rope is not None and len(rope) != 7:
        raise ValueError("key_affine: rope is rope_means' seven tables")
    if rope is None:
        mu = k64.mean(axis=0)  # [KV, D]
    else:
        cos, sin, cos_mean, sin_mean = rope[:4]  # (the outer products' means: query_moment's)
        m = _before_rope(k64, cos, sin).mean(axis=0)  # [KV, D]
        mu = m * cos_mean + _rotate_half(m) * sin_mean
    ms_k, ms_q = (k64 * k64).mean(axis=0), (q64 * q64).mean(axis=(0, 2))
    if tie_pairs:
        ms_k, ms_q = _pair_mean(ms_k), _pair_mean(ms_q)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (np.sqrt(ms_k) / np.sqrt(ms_q)) ** alpha
    s = np.where(np.isfinite(s) & (s > 0), s, 1.0)  # a channel silent in k or q: left as it is
    s = s / np.sqrt((s * s).mean(axis=-1, keepdims=True))
    s32 = s.astype(np.float32)
    d = k.shape[-1]
    f = error_feedback(query_moment(q64, rope), s) if feedback else np.zeros((k.shape[1], d, d))
    affine = np.concatenate([np.stack([mu, 1.0 / s32, s32], axis=1), f], axis=1).astype(np.float32)  # [KV, 3 + D, D]
    return torch.from_numpy(np.ascontiguousarray(affine))


def query_moment(q: np.ndarray, rope=None) -> np.ndarray:
    """[KV, D, D]: E q q^T over the queries q [n, KV, G, D] of a KV head's G query heads. With ``rope``
    (:func:`rope_means`), the moment a cache of the whole context meets: each query rotated back by its
    position (before RoPE, a), then taken to every position p of the context, E over p of
    R(p) a a^T R(p)^T, with R(p) a = a cos_p + rotate_half(a) sin_p: the same RoPE-invariant form as mu's."""
    if rope is None:
        x = q.transpose(1, 0, 2, 3).reshape(q.shape[1], -1, q.shape[-1])  # [KV, n G, D]
        return x.transpose(0, 2, 1) @ x / x.shape[1]
    cos, sin, _, _, mcc, mcs, mss = rope
    a = _before_rope(q, cos, sin).transpose(1, 0, 2, 3).reshape(q.shape[1], -1, q.shape[-1])
    b = _rotate_half(a)
    n = a.shape[1]
    aa, ab, bb = (x.transpose(0, 2, 1) @ y / n for x, y in ((a, a), (a, b), (b, b)))
    return mcc * aa + mcs * ab + mcs.T * ab.transpose(0, 2, 1) + mss * bb


DAMP = 0.01  # GPTQ's dampening: this share of the moment's mean diagonal added to it


def error_feedback(moment: np.ndarray, s: np.ndarray, rotated: bool = True) -> np.ndarray:
    """F [KV, D, D] (``kv.c``'s ``kv_store_blocks``) for rows stored as H ((k - mu) / s) (``rotated``
    False: (k - mu) / s, H the identity), from the
    queries' moment [KV, D, D] before smoothing: a stored row x meets H (q s), whose moment is
    C = H diag(s) E[q q^T] diag(s) H; U is the upper Cholesky factor of (C + DAMP mean(diag C) I)^-1 and
    F[j][i] = U[j][i] / U[j][j] for i > j (GPTQ's update, Frantar et al. 2022, along one row: rounding x_j
    leaves an error e_j, and taking e_j F[j][i] off each later x_i leaves the least e^T C e). The moment
    weighs every position alike, though a key meets only the queries after it: a choice, as mu's."""
    kv, d, _ = moment.shape
    h = hadamard(torch.eye(d, dtype=torch.float32)).double().numpy() if rotated else np.eye(d)
    out = np.zeros((kv, d, d))
    for g in range(kv):
        c = h @ (s[g][:, None] * moment[g] * s[g][None, :]) @ h
        c = c + max(DAMP * np.trace(c) / d, 1e-30) * np.eye(d)  # a head no query reaches: F = 0
        u = np.linalg.cholesky(np.linalg.inv(c)).T  # upper: inv(c) = u^T u
        out[g] = np.triu(u / np.diag(u)[:, None], 1)
    return out


def _pair_mean(x: np.ndarray) -> np.ndarray:
    """[..., D] -> the mean of channels d and d + D / 2 (a RoPE pair, rotate_half's layout) in both."""
    half = x.shape[-1] // 2
    m = (x[..., :half] + x[..., half:]) / 2
    return np.concatenate([m, m], axis=-1)


def rope_means(target, key, n: int, context: int) -> tuple[np.ndarray, ...]:
    """The RoPE of the layers whose ``layer.rope`` is ``key``, float64 from the target's own tables: cos, sin [n, D] at positions 0 .. n - 1,
    their means [D] over positions 0 .. context - 1, and the means of their outer products [D, D] over
    those positions, cos cos^T, cos sin^T, sin sin^T."""
    cos, sin = target._rope_rows(torch.arange(context))[key]
    return rope_tables(cos.double().numpy(), sin.double().numpy(), n)


def rope_tables(cos: np.ndarray, sin: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """:func:`rope_means`' tuple from cos, sin [context, D]."""
    p = cos.shape[0]
    return cos[:n], sin[:n], cos.mean(axis=0), sin.mean(axis=0), cos.T @ cos / p, cos.T @ sin / p, sin.T @ sin / p


@torch.inference_mode()
def calibrate_key_affine(target, token_ids: Sequence[int], **keywords) -> list[torch.Tensor]:
    """The affine of each of ``target``'s layers (a ``NativeTarget``) from one prefill of ``token_ids``
    (cut to its context length) over a float32 cache of its own."""
    ids = list(token_ids)[: min(CALIBRATION_TOKENS, target.context_length)]
    blocks = -(-len(ids) // BLOCK)
    shape = (blocks, target.n_kv_heads, BLOCK, target.head_dim)
    k, v = ([torch.empty(shape, dtype=torch.float32) for _ in target.layers] for _ in range(2))
    cache = PagedKVCache(BlockPool(blocks, BLOCK, False), k, v)
    context = target.context_length if MU_POSITIONS is None else min(MU_POSITIONS, target.context_length)
    keys = {layer.rope for layer in target.layers}  # one table for every layer that shares a RoPE
    tables = {key: rope_means(target, key, len(ids), max(context, len(ids))) for key in keys}
    rope = [tables[layer.rope] for layer in target.layers]
    stats = _KeyStatistics(len(ids), BLOCK, rope, **keywords)
    target.forward_batch(cache, [BatchEntry(ids, 0, list(range(blocks)), 0)], observe=stats)
    return stats.affines
