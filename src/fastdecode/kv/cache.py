"""The paged KV cache's bookkeeping: blocks, block tables, a free list, prefix sharing.

After vLLM's PagedAttention (Kwon et al. 2023) and its v1 ``KVCacheManager``,
kept small. The cache is a pool of ``num_blocks`` fixed-size blocks of
``block_size`` positions per layer (the tensors belong to the target:
``NativeTarget.new_kv_cache``); a request's positions live in the blocks its
*block table* lists, position t in ``table[t // block_size]``. The books
decide which block ids a request gets; ``PagedKVCache`` holds the pool's
tensors beside them, and :class:`BatchEntry` places one sequence's rows of a
pass on its blocks (what an executor's forward takes, ``fastdecode.backends.base``).

Terms:

* **free** - a block no running request holds (``ref_count == 0``). Free blocks
  sit in one queue, least recently freed first; allocation takes from its front.
* **cached** - a full block registered under its token prefix. A cached block
  stays reusable after its request ends, until allocation evicts it (it is
  still free). A request whose prompt starts with cached blocks takes them
  (``ref_count += 1``) and skips their part of the prefill.
* **prefix key** - ``(parent entry id, the block's token ids)``: a block is
  only shared when its whole prefix is identical. Entry ids are never reused,
  and the dict compares the full key, so a hash collision cannot make two
  different prefixes share KV.

Rolling back rejected draft tokens needs nothing here: a rejected position is
simply overwritten by the next pass, and blocks are only registered once every
position in them holds a committed token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastdecode.errors import ConfigError

PrefixKey = tuple[int, tuple[int, ...]]


@dataclass
class BlockTable:
    """One request's blocks, in position order, and how far they are registered for sharing."""

    blocks: list[int] = field(default_factory=list)
    num_registered: int = 0  # leading blocks registered (or found) in the prefix cache
    parent_entry: int = 0  # entry id of the last registered block (0: the empty prefix)


class BlockPool:
    """Which blocks are free, who holds each block, and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"the KV cache needs at least one block, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[PrefixKey, int] = {}  # prefix key -> block
        self._key_of: dict[int, PrefixKey] = {}  # block -> its prefix key, while cached
        self._entry_of: dict[int, int] = {}  # block -> its entry id, while cached
        self._next_entry = 1
        # Counted in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits.
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

    # -- counts --------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocate / free -----------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n free blocks (evicting cached ones, oldest first); the caller checked ``num_free``."""
        if n > len(self._free):
            raise RuntimeError(
                f"asked for {n} KV blocks with {len(self._free)} free"
            )  # a scheduler bug, not user input
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each (held) block: a draft path that reads a request's
        committed blocks (released with ``free`` like any other)."""
        for block in blocks:
            if self.ref_count[block] <= 0:
                raise RuntimeError(f"KV block {block} shared while free")
            self.ref_count[block] += 1

    def free(self, blocks: Sequence[int], reuse_first: bool = False) -> None:
        """Release one reference to each block. Freed in reverse, so a request's
        tail blocks (the least likely to be shared) are evicted first. ``reuse_first``:
        the blocks hold nothing worth keeping (a draft path's scratch), so they go to the
        front of the queue and are allocated again before any cached block is evicted."""
        for block in reversed(blocks):
            if self.ref_count[block] <= 0:
                raise RuntimeError(f"KV block {block} freed twice")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None
                if reuse_first and block not in self._key_of:
                    self._free.move_to_end(block, last=False)

    def is_shared(self, block: int) -> bool:
        """Whether a holder other than one request may read the block: another reference, or
        the prefix cache's entry (a KV policy copies such a block before writing it)."""
        return self.ref_count[block] > 1 or block in self._key_of

    def _evict(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]
            del self._entry_of[block]

    # -- prefix cache --------------------------------------------------------
    def take_cached_prefix(
        self, token_ids: Sequence[int], table: BlockTable, max_tokens: int, count: bool = True
    ) -> int:
        """Put the cached blocks that ``token_ids`` starts with into the (empty)
        ``table``, at most ``max_tokens`` positions' worth; return the positions
        they cover. Counts the query and the hit (``count``: a prompt's first lookup,
        not a preempted request's refill)."""
        if table.blocks:
            raise RuntimeError("take_cached_prefix needs an empty block table")
        B = self.block_size
        if count:
            self.prefix_queries_tokens += len(token_ids)
        if not self.enable_prefix_caching:
            return 0
        parent = 0
        for i in range(max_tokens // B):
            block = self._cached.get((parent, tuple(token_ids[i * B : (i + 1) * B])))
            if block is None:
                break
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1
            table.blocks.append(block)
            parent = self._entry_of[block]
        table.num_registered, table.parent_entry = len(table.blocks), parent
        hit = len(table.blocks) * B
        if count:
            self.prefix_hits_tokens += hit
        return hit

    def register_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_committed: int) -> None:
        """Register every block of ``table`` whose positions all hold committed
        tokens (``token_ids[:num_committed]`` have their KV in the cache)."""
        if not self.enable_prefix_caching:
            return
        B = self.block_size
        while table.num_registered < min(num_committed // B, len(table.blocks)):
            i = table.num_registered
            block = table.blocks[i]
            key = (table.parent_entry, tuple(token_ids[i * B : (i + 1) * B]))
            existing = self._cached.get(key)
            if existing is None:
                self._cached[key], self._key_of[block] = block, key
                self._entry_of[block] = entry = self._next_entry
                self._next_entry += 1
            else:  # the same prefix computed by another request: keep its entry, this block stays private
                entry = self._entry_of[existing]
            table.parent_entry = entry
            table.num_registered += 1


@dataclass
class PagedKVCache:
    """A paged KV cache: the blocks' bookkeeping and, per layer, the K and V pools
    [num_blocks, KV, block_size, D] (above), and the keys' affine the rows were written with
    (``kernels/kv_formats.py``; None: none): part of what the pools mean, so every executor that
    reads or writes them (a drafter in the target's cache, a KV policy's moves) takes it from here."""

    pool: BlockPool
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_affine: list[torch.Tensor] | None = None  # per layer, float32 [KV, 3 + D, D]

    def block_bytes(self) -> int:
        """Bytes one block takes in every layer's K and V pools, as stored (a quantized cache's
        scales included; 0 where the executor keeps its own cache and the pool only the books)."""
        return sum(t[0].numel() * t.element_size() for t in self.k + self.v)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K and V into block ``dst`` in every layer (copy-on-write:
        a draft path that branches off a sequence inside a partly filled block)."""
        for k, v in zip(self.k, self.v):
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])


@dataclass(frozen=True)
class BatchEntry:
    """One sequence's rows in a batched forward (``Executor.forward_batch``)."""

    token_ids: Sequence[int]  # the rows fed: a prompt chunk, or the last token and a draft
    start: int  # the position of token_ids[0]
    block_table: Sequence[int]  # the sequence's KV blocks, covering positions 0 .. start + len(token_ids) - 1
    num_logits: int  # logits for the last num_logits rows (0: a prompt chunk before the last)
    # Token-tree verification: positions start - len(shared) .. start - 1 of this sequence are
    # rows of earlier entries of the same pass, (entry index, index in its token_ids), at the
    # same positions: a path sharing a prefix with an earlier path of the tree. Their keys and
    # values are copied into this entry's blocks before the attention, not computed again.
    shared: Sequence[tuple[int, int]] = ()
    # H2O (fastdecode.kv.policy): a list the pass appends its rows' attention to,
    # [rows, layers, KV heads, slots] float64; None: not computed (the usual case).
    attention: list | None = None
