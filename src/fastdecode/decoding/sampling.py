"""Sampling parameters and the logits -> probabilities transform.

The same transform makes the target's ``p`` for plain decoding and for every
position of a speculative verification, which is what keeps sampling lossless:
speculative decoding reproduces whatever distribution plain decoding samples
from, so both must share one definition of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdecode.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy (argmax); top-k/top-p apply only when sampling."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64
        ):  # torch.Generator takes 64 bits
            raise ConfigError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution p after temperature, top-k and top-p.

    logits: [num_positions, vocab_size]; returns float32 [num_positions, vocab_size].
    Uses transformers' own warpers so "top-p" means exactly what it means in
    ``model.generate``; imported only where top-k or top-p is asked for (transformers'
    import costs over a second).
    """
    scores = logits.float()
    # Shift by the max first: a tiny temperature then sends the other scores to
    # -inf instead of overflowing the max to +inf (softmax would give NaN).
    scores = (scores - scores.max(dim=-1, keepdim=True).values) / params.temperature
    if params.top_k > 0:
        from transformers.generation.logits_process import TopKLogitsWarper

        scores = TopKLogitsWarper(top_k=params.top_k)(None, scores)
    if params.top_p < 1.0:
        from transformers.generation.logits_process import TopPLogitsWarper

        scores = TopPLogitsWarper(top_p=params.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)
