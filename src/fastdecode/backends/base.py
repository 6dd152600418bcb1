"""The interface the decode loop needs from a target model.

A target owns a KV cache of ``cache_len`` positions. ``forward`` appends tokens
at the end of the cache and scores them; ``truncate`` rolls the cache back,
which is how rejected draft tokens are forgotten (mlx-lm's ``trim`` contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch


class Target(ABC):
    name: str
    weights: str  # precision of the linear weights: "float" (the model's dtype), "int8", "int4"
    float_kernel: str | None = None  # the GEMM the native path runs for float/int8 weights ("rowgemm" / "torch"); None elsewhere
    vocab_size: int
    context_length: int
    device: torch.device

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache for a new request."""

    @property
    @abstractmethod
    def cache_len(self) -> int: ...

    @abstractmethod
    def forward(self, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        """Append ``token_ids`` to the cache; return the logits of the last
        ``num_logits`` positions, [num_logits, vocab_size]. Row i predicts the
        token that follows position ``cache_len_before + len(token_ids) - num_logits + i``."""

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` positions."""
