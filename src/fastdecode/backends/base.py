"""The contracts between the engine and a model.

``Executor``: the batched contract the engine runs on. One executor is shared by every
request: it holds weights and kernels and no sequence's state. A forward runs ragged rows
of many sequences (``BatchEntry``, ``fastdecode.kv.cache``) over a paged KV cache the engine owns
(``fastdecode.kv.cache.PagedKVCache``); each entry names its own blocks. Rolling back a
rejected draft costs nothing: the next pass overwrites the rows (the gpt-fast design).

``SequenceModel``: one sequence with a cache of its own, appended to and trimmed
(mlx-lm's ``trim`` contract): what a drafter with a model of its own and the probes
use. ``PagedSequence`` is one over any executor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdecode.errors import ConfigError
from fastdecode.kv.cache import BatchEntry, PagedKVCache


@dataclass(frozen=True)
class ExpertsProfile:
    """What the cost of a mixture of experts' pass grows with: each of ``n_layers`` experts FFNs routes a
    row to ``top_k`` of ``n_experts`` experts, and a pass runs each expert its rows route to once.
    ``expert_share``: the bytes of one expert over those one decode step (one row) streams."""

    n_layers: int
    n_experts: int
    top_k: int
    expert_share: float


class Executor(ABC):
    """A model's forward over ragged rows on a paged KV cache, shared by every request.

    ``batched`` False: the executor runs one sequence at a time (the transformers
    backend); the engine then runs one request at a time, without chunked prefill
    or a prefix cache, and the cache it gets from ``new_kv_cache`` only keeps the books.
    """

    name: str
    weights: str  # the numeric model of the linear weights: "float" (the model's dtype), "int8", "q4_0", ...
    float_kernel: str | None = (
        None  # the GEMM family the layers run ("rowgemm" / "qdot" / "torch"); None where not native
    )
    kernel_note: str | None = None  # why a slower path than asked was taken (front ends print it); None when none was
    batched: bool = True
    vocab_size: int
    context_length: int
    device: torch.device
    model: object  # the transformers model the executor runs

    @abstractmethod
    def new_kv_cache(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> PagedKVCache:
        """A pool of ``num_blocks`` blocks of ``block_size`` positions (the caller owns it)."""

    @abstractmethod
    def forward_batch(self, cache: PagedKVCache, entries: Sequence[BatchEntry]) -> torch.Tensor:
        """Write every entry's rows into its blocks and return the logits of each entry's last
        ``num_logits`` rows, entries in order: [sum of num_logits, vocab_size]. Every row gets
        the bits a one-row pass at its position would get (row invariance)."""

    @abstractmethod
    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` positions takes over every layer (K and V)."""

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step streams."""

    def experts_profile(self) -> ExpertsProfile | None:
        """A mixture of experts' routing shape, for the engine's cost model (None: no experts FFN, or
        the executor does not count what it runs)."""
        return None

    def take_experts_run(self) -> int | None:
        """The distinct experts run since the last call, summed over the layers (a pass's: the engine
        takes it after each pass); None where ``experts_profile`` is None."""
        return None

    def kv_policy_unsupported(self) -> str | None:
        """Why this executor cannot run a KV policy other than ``full`` (None: it can)."""
        return f"the {self.name} target keeps the full cache (KV policies need the native backend)"

    def move_kv(
        self, cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor, lanes=None
    ) -> None:
        """Move K and V rows from (block, offset) ``src`` [n, 2] to ``dst`` [n, 2], each key
        re-rotated by ``shift`` [n] positions (``fastdecode.kv.policy``: positions within the cache),
        in every layer and KV head, or only in the (layer, KV head) ``lanes`` [n, 2] given."""
        raise ConfigError(self.kv_policy_unsupported() or "this target cannot move KV rows")

    def release(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Give back memory held outside a cache the engine owns (nothing by default)."""


class SequenceModel(ABC):
    """One sequence with a KV cache of its own: ``forward`` appends, ``truncate`` rolls back."""

    vocab_size: int
    context_length: int

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache for a new sequence (and free its memory)."""

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


class PagedSequence(SequenceModel):
    """One sequence on an executor, in a private paged cache that grows by doubling: a
    drafter's model for one request, or a probe's. The executor stays shared."""

    BLOCK = 64

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.vocab_size = executor.vocab_size
        self.context_length = executor.context_length
        self.reset()

    def reset(self) -> None:
        self._cache: PagedKVCache | None = None
        self._table: list[int] = []
        self._pos = 0

    @property
    def cache_len(self) -> int:
        return self._pos

    def truncate(self, length: int) -> None:
        self._pos = min(self._pos, length)  # rejected positions are overwritten by the next forward

    def _reserve(self, needed: int) -> None:
        blocks = -(-needed // self.BLOCK)
        if self._cache is not None and blocks <= self._cache.pool.num_blocks:
            return
        grown = self.executor.new_kv_cache(
            max(blocks, 2 * len(self._table), 4), self.BLOCK, enable_prefix_caching=False
        )
        if self._cache is not None:  # keep what is cached: blocks 0.. are the positions in order
            for old, new in zip(self._cache.k + self._cache.v, grown.k + grown.v):
                new[: old.shape[0]] = old
        self._cache, self._table = grown, list(range(grown.pool.num_blocks))

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        start = self._pos
        if start + len(token_ids) > self.context_length:
            raise ConfigError(
                f"sequence of {start + len(token_ids)} tokens exceeds the context length {self.context_length}"
            )
        self._reserve(start + len(token_ids))
        out = self.executor.forward_batch(self._cache, [BatchEntry(token_ids, start, self._table, num_logits)])
        self._pos = start + len(token_ids)
        return out
