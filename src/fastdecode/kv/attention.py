"""What a KV policy asks of the backend, stated below both so that the backend imports no policy:
the attention each row gives every slot (:class:`AttentionObserver`, H2O's scores, computed in
torch beside the kernel), and the re-rotation of a key that moves to another slot
(:func:`rotate_keys`, :func:`check_rope_shift`: positions within the cache, ``fastdecode.kv.policy``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fastdecode.kernels.kv_formats import pool_format


class AttentionObserver:
    """For the entries of a pass that ask (``BatchEntry.attention``: an H2O request), the
    attention weight each row gives every slot of its sequence in each (layer, KV head) lane:
    the largest over the query heads that share the KV head (a token one of them needs is kept
    for it; their sum measured worse), times the slot's value norm when the values are given,
    [rows, layers, KV, slots] float64, appended to the entry's list after the pass.

    The attention kernel returns no weights (and keeps its signature), so this recomputes
    softmax(q K^T * scale) in torch from the pass's queries and the cache's keys: per observed
    row and layer, one [H, D] x [D, slots] product in float64 - about the attention's own
    arithmetic again, in torch, for those rows only. Each row is computed alone with shapes
    that depend only on its slot, so its bits are the same in a plain step, a verification
    pass or a prompt chunk. Called once per layer, in layer order."""

    def __init__(
        self, entries, first_rows: Sequence[int], block_size: int, scale: float, softcap: float | None = None
    ) -> None:
        self.softcap = softcap  # the scores capped as the model's attention caps them (Gemma 2); None: not
        self.block_size, self.scale = block_size, scale
        self.watch = [(e, first_rows[s], []) for s, e in enumerate(entries) if e.attention is not None]

    def __bool__(self) -> bool:
        return bool(self.watch)

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        window: int | None,
        v_pool: torch.Tensor | None = None,
        k_affine: torch.Tensor | None = None,
    ) -> None:
        """One layer: q [n, H, D] (rotated), k_pool and v_pool [num_blocks, KV, block_size, row] holding this
        pass's keys and values, the keys stored with ``k_affine`` [KV, 3 + D, D] (``kv_formats``) or None. With v_pool each weight is scaled by its token's value norm (VATP, Guo et
        al. 2024: a token's contribution to the output is its weight times its value, so a large weight on
        a small value matters little; SmolLM2 at a 20% budget 1.129x -> 1.120x the in-window perplexity,
        docs/benchmarks.md 11b)."""
        B, KV = self.block_size, k_pool.shape[1]
        for e, first, layers in self.watch:
            n, length = len(e.token_ids), e.start + len(e.token_ids)
            t = torch.arange(length)
            blocks = torch.as_tensor(list(e.block_table), dtype=torch.long)[t // B]
            keys = (
                pool_format(k_pool, q.shape[-1]).load(k_pool[blocks, :, t % B], k_affine).transpose(0, 1).double()
            )  # [KV, length, D]
            acc = torch.zeros(n, KV, length, dtype=torch.float64)
            norms = torch.ones(KV, length, dtype=torch.float64)
            if v_pool is not None:  # [KV, length]: each token's value norm
                norms = pool_format(v_pool, q.shape[-1]).load(v_pool[blocks, :, t % B]).transpose(0, 1).double()
                norms = norms.norm(dim=-1)
            for i in range(n):
                p = e.start + i
                lo = 0 if window is None else max(0, p + 1 - window)
                k = keys[:, lo : p + 1].contiguous()  # [KV, L, D]
                qi = q[first + i].double().reshape(KV, -1, q.shape[-1])  # [KV, H / KV, D]
                s = torch.matmul(qi, k.transpose(1, 2)) * self.scale  # [KV, H / KV, L]
                if self.softcap is not None:
                    s = torch.tanh(s / self.softcap) * self.softcap
                w = torch.softmax(s, dim=-1)
                acc[i, :, lo : p + 1] = w.amax(dim=1) * norms[:, lo : p + 1]
            layers.append(acc)

    def deliver(self) -> None:
        for e, _, layers in self.watch:
            e.attention.append(torch.stack(layers, dim=1))  # [rows, layers, KV, slots]


def rotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate stored keys k [n, KV, D] by the angles whose cos and sin [n, D] are given
    (half-split RoPE, as the model's own), in float32; returns k's dtype."""
    x = k.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :].float() + rotated * sin[:, None, :].float()).to(k.dtype)


def check_rope_shift(rotary) -> str | None:
    """Why keys cannot be re-rotated by a shift under this rotary embedding (None: they can)."""
    # one attention_scaling, or one per layer type (Gemma 3: full_attention_attention_scaling, ...)
    for name, scaling in vars(rotary).items():
        if name.endswith("attention_scaling") and not math.isclose(float(scaling), 1.0):
            return f"its RoPE scales cos and sin by {scaling} (not a pure rotation a shift can compose with)"
    if "dynamic" in str(getattr(rotary, "rope_type", "")):
        return "its dynamic RoPE changes with the sequence length"
    return None
