"""The interface the decode loop needs from a target model.

A target owns a KV cache of ``cache_len`` positions. ``forward`` appends tokens
at the end of the cache and scores them; ``truncate`` rolls the cache back,
which is how rejected draft tokens are forgotten (mlx-lm's ``trim`` contract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's rows in a batched forward (``NativeTarget.forward_batch``)."""

    token_ids: Sequence[int]  # the rows fed: a prompt chunk, or the last token and a draft
    start: int  # the position of token_ids[0]
    block_table: Sequence[int]  # the sequence's KV blocks, covering positions 0 .. start + len(token_ids) - 1
    num_logits: int  # logits for the last num_logits rows (0: a prompt chunk before the last)
    # Token-tree verification: positions start - len(shared) .. start - 1 of this sequence are
    # rows of earlier entries of the same pass, (entry index, index in its token_ids), at the
    # same positions: a path sharing a prefix with an earlier path of the tree. Their keys and
    # values are copied into this entry's blocks before the attention, not computed again.
    shared: Sequence[tuple[int, int]] = ()


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
