"""KV-cache policies: what a request's cache keeps once it is full (full, sinks, H2O).

Terms (defined once):

* **slot** - a place in a request's cache; slot s lives in ``table.blocks[s // block_size]``.
  Under the full policy a token's slot is its position in the context. Under ``sinks`` and
  ``h2o`` the cache holds at most ``capacity`` slots; when it is full the policy evicts some
  tokens and the kept ones are *compacted* into slots 0 .. kept - 1, in context order, so a
  request's slots are always one contiguous run the attention kernel reads as it is.
* **positions within the cache** (StreamingLLM, Xiao et al. 2023, §3.2): RoPE rotates a query
  and a key by their slots, not by their places in the text, so the model never sees a
  distance larger than its cache. The native decoder rotates each key by its slot when it
  writes it and stores it rotated; a kept key that moves from slot a to slot b is therefore
  re-rotated by b - a when it moves (rotations compose: R(b - a) R(a) = R(b)), as llama.cpp's
  context shift does. Keys stored before rotation would need the attention kernel to rotate
  every key on every read (a kernel change, and a cost each step); moving costs one pass over
  the kept keys and values per eviction, and an eviction drops ``evict_tokens`` tokens at a time
  (default one block) so that it is paid once per that many tokens.
* **sinks** (StreamingLLM): the first ``sinks`` tokens (default 4) and a window of the most
  recent tokens; ``sinks:0`` is the plain sliding window the paper compares against.
* **h2o** (Zhang et al. 2023): heavy hitters by accumulated attention and a recent window,
  kept per *lane* - one (layer, KV head) - as the paper keeps them per head: slot s of layer l,
  head h holds its own token, and each lane evicts its own lowest-scored tokens. Every lane
  keeps the same number of slots, so one block table still serves every layer and ``budget``
  (a count, or a fraction of the context length) is exactly the slots each lane keeps: the
  cache holds ``budget / context`` of the full cache's bytes. A lane keeps the first ``sinks``
  tokens (StreamingLLM's attention sinks, default 4), the ``recent`` share of the budget as its
  most recent tokens, and between them the tokens of highest *mean* attention: the attention
  each accepted row gave the token (the largest over the query heads that share the KV head,
  times the token's value norm as VATP weighs it, in float64, by :class:`~fastdecode.kv.attention.AttentionObserver`)
  divided by the number of rows that saw it. The paper's raw sum favours old tokens, seen by
  more rows; measured on SmolLM2-135M (kv_eval: docs/benchmarks.md, 11b) at a 20% budget: 1.47x
  the in-window perplexity with one set for every lane and raw sums, 1.13x with per-lane sets,
  means, the max over query heads and 4 tokens evicted at a time, 1.12x with value norms.

Rules:

* eviction is decided from accepted tokens only: a request evicts before a pass, when its
  cache is full, from its committed tokens (and, for H2O, the attention their rows gave);
  a pass never crosses a full cache (the scheduler cuts prompt chunks and draft lengths at
  it), so plain decoding and speculative decoding evict at the same token with the same
  scores, and speculative output stays token-identical to plain decoding under one policy;
* a block another holder may read (another request's reference, or the prefix cache's
  entry) is never written: compaction copies its kept rows into a fresh block of this
  request's (copy-on-write) and drops only this request's reference. A request with a
  policy other than ``full`` never registers its own blocks for sharing (its slots stop
  being its prefix once it evicts), and an H2O request takes nothing from the prefix cache
  (its scores need every prompt row's attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fastdecode.errors import ConfigError
from fastdecode.kv.cache import BlockTable, PagedKVCache

DEFAULT_SINKS = 4
DEFAULT_H2O_BUDGET = 0.2
DEFAULT_H2O_RECENT = 0.5  # the paper's split: half heavy hitters, half recent tokens
# measured (kv_eval, docs/benchmarks.md 11b): 4 tokens dropped at a time cost ~4 points of
# perplexity less than a 16-token block at a time, and leave a pass room for 3 drafted tokens
DEFAULT_H2O_EVICT = 4


@dataclass(frozen=True)
class KVPolicy:
    """A request's KV policy, as the user gives it: ``full``, ``sinks[:S[,W]]``,
    ``h2o[:BUDGET[,RECENT[,SINKS[,EVICT]]]]``.

    sinks: S sink tokens (default 4) and a window of W recent tokens (default: the rest of the
    context). h2o: BUDGET slots in every (layer, KV head), a count (>= 2) or a fraction of the
    context length (0 < b <= 1, default 0.2), of which RECENT (a fraction of the budget, default
    0.5) are the most recent tokens and SINKS (default 4) the first. ``evict_tokens`` (h2o's
    EVICT): tokens dropped at each eviction (default: one block; h2o: 4)."""

    name: str = "full"
    sinks: int = DEFAULT_SINKS
    window: int | None = None
    budget: float = DEFAULT_H2O_BUDGET
    recent: float = DEFAULT_H2O_RECENT
    evict_tokens: int | None = None

    @classmethod
    def parse(cls, text: str | KVPolicy) -> KVPolicy:
        if isinstance(text, KVPolicy):
            return text
        if not isinstance(text, str):
            raise ConfigError(f"kv_policy must be a string such as 'sinks' or 'h2o:0.2', got {text!r}")
        name, _, args = text.strip().partition(":")
        rule = RULES.get(name)
        if rule is None:
            raise ConfigError(
                f"unknown kv_policy {text!r}; choose one of: {', '.join(r.syntax for r in RULES.values())}"
            )
        values = [a.strip() for a in args.split(",")] if args else []
        try:
            if len(values) <= len(rule.arguments):
                return cls(name, **{f: t(v) for (f, t), v in zip(rule.arguments, values)})
        except ValueError:
            pass
        raise ConfigError(f"kv_policy {text!r}: expected {rule.syntax}, with numbers")

    def __post_init__(self) -> None:
        if self.name not in RULES:
            raise ConfigError(f"unknown kv_policy {self.name!r}; choose one of {', '.join(RULES)}")
        if self.sinks < 0 or (self.window is not None and self.window < 2):
            raise ConfigError(
                f"kv_policy sinks: need S >= 0 sinks and a window W >= 2, got {self.sinks}, {self.window}"
            )
        if not (0 < self.budget <= 1 or (self.budget >= 2 and self.budget == int(self.budget))):
            raise ConfigError(f"kv_policy h2o: the budget is a fraction in (0, 1] or a count >= 2, got {self.budget}")
        if not 0 < self.recent < 1:
            raise ConfigError(f"kv_policy h2o: the recent share of the budget must be in (0, 1), got {self.recent}")
        if self.evict_tokens is not None and self.evict_tokens < 1:
            raise ConfigError(f"kv_policy: evict_tokens must be >= 1, got {self.evict_tokens}")

    @property
    def rule(self) -> Rule:
        return RULES[self.name]

    @property
    def is_full(self) -> bool:
        return self.rule.size is None

    @property
    def uses_prefix_cache(self) -> bool:
        return self.rule.uses_prefix_cache

    def new_state(self, context_length: int, block_size: int) -> KVState | None:
        """A request's state under this policy (None under ``full``), its capacity checked against the context."""
        if self.is_full:
            return None
        capacity, keep_always, recent = self.rule.size(self, context_length)
        if not 2 <= capacity <= context_length or capacity <= keep_always + recent + 1:
            raise ConfigError(
                f"kv_policy {self.name}: a cache of {capacity} slots does not fit the context length "
                f"{context_length} (or leaves no room to evict)"
            )
        evictable = capacity - keep_always - recent  # > 1; at least one of them stays
        evict_tokens = max(1, min(self.evict_tokens or self.rule.evict_tokens or block_size, evictable - 1))
        return KVState(self, capacity, recent, evict_tokens, keep_first=keep_always)


@dataclass
class KVState:
    """One request's policy state (the request owns it): which context positions its slots
    hold, and under H2O each slot's accumulated attention.

    A *lane* is one (layer, KV head) of the cache: under H2O each lane keeps its own tokens
    (slot s of layer l, head h holds ``positions[l, h, s]``), as the paper keeps heavy hitters
    per head; every lane keeps the same number of slots, so the block table, the slot count
    and the bytes are the request's as under one shared set. Policies that keep one set
    (``sinks``) hold ``positions`` as [1, 1, slots], broadcast over every lane."""

    policy: KVPolicy
    capacity: int  # the most slots the request's cache holds (in every lane)
    recent: int  # h2o: the most recent slots always kept
    evict_tokens: int  # tokens dropped at each eviction (from every lane)
    keep_first: int = 0  # h2o: the first slots (sink tokens) always kept
    # [lanes: layers or 1, KV heads or 1, slots]: the context position each committed slot holds
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 1, 0, dtype=torch.long))
    num_committed: int = 0  # context positions committed so far (kept or evicted)
    # h2o: each slot's accumulated attention, [layers, KV heads, slots] (shaped by the first pass)
    scores: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 1, 0, dtype=torch.float64))
    pending: list[torch.Tensor] = field(default_factory=list)  # the last pass's [rows, layers, KV, slots]
    pending_start: int = 0  # the context position of the last pass's first row

    @property
    def wants_attention(self) -> bool:
        return self.policy.rule.wants_attention

    @property
    def num_kept(self) -> int:
        return self.positions.shape[-1]

    @property
    def num_evicted(self) -> int:
        return self.num_committed - self.num_kept

    def kept_positions(self, layer: int = 0, head: int = 0) -> list[int]:
        """The context positions lane (``layer``, ``head``) keeps, in slot order."""
        lanes = self.positions
        return lanes[min(layer, lanes.shape[0] - 1), min(head, lanes.shape[1] - 1)].tolist()

    def room(self) -> int:
        """Slots left before the cache is full (rows the next pass may feed)."""
        return self.capacity - self.num_kept

    def slot(self, position: int) -> int:
        """The slot of a context position not yet committed (fed from the next slot on)."""
        return position - self.num_evicted

    def sync(self, num_computed: int) -> None:
        """Record context positions committed up to ``num_computed`` (a pass, or a prefix-cache hit)."""
        if num_computed > self.num_committed:
            new = torch.arange(self.num_committed, num_computed).expand(*self.positions.shape[:2], -1)
            self.positions = torch.cat([self.positions, new], dim=-1)
            if self.wants_attention:
                fresh = self.scores.new_zeros(*self.scores.shape[:2], num_computed - self.num_committed)
                self.scores = torch.cat([self.scores, fresh], dim=-1)
            self.num_committed = num_computed

    def accept(self, num_computed: int) -> None:
        """After a pass: commit up to ``num_computed`` and add the accepted rows' attention, row
        by row in context order (the order plain decoding adds them in), to the H2O scores."""
        accepted = num_computed - self.pending_start
        self.sync(num_computed)
        for rows in self.pending:  # [rows, layers, KV, slots of the pass]; a row is 0 past its own slot
            self._shape_lanes(rows.shape[1:3])
            slots = min(rows.shape[-1], self.scores.shape[-1])
            for i in range(min(accepted, rows.shape[0])):
                self.scores[..., :slots] += rows[i, ..., :slots]
        self.pending = []

    def _shape_lanes(self, lanes: torch.Size) -> None:
        """Give every lane its own positions and scores (the first pass's attention tells how many)."""
        if self.scores.shape[:2] != lanes:
            self.scores = self.scores.expand(*lanes, -1).clone()
            self.positions = self.positions.expand(*lanes, -1).clone()

    def keep(self) -> torch.Tensor:
        """The slots to keep at an eviction (the cache is full), ascending: [lanes, lanes, kept]."""
        return self.policy.rule.keep(self)

    def evicted(self, keep: torch.Tensor) -> None:
        keep = keep.expand(*self.positions.shape[:2], -1)
        self.positions = self.positions.gather(-1, keep)
        if self.wants_attention:
            self.scores = self.scores.gather(-1, keep.expand(*self.scores.shape[:2], -1))


# ---------------------------------------------------------------- the policies: one rule each


def _sinks_size(policy: KVPolicy, context_length: int) -> tuple[int, int, int]:
    window = policy.window if policy.window is not None else context_length - policy.sinks
    return policy.sinks + window, policy.sinks, 0


def _sinks_keep(state: KVState) -> torch.Tensor:
    """The sinks, and the window without its oldest ``evict_tokens``."""
    s, m = state.policy.sinks, state.num_kept
    return torch.tensor([*range(s), *range(s + state.evict_tokens, m)], dtype=torch.long)[None, None]


def _h2o_size(policy: KVPolicy, context_length: int) -> tuple[int, int, int]:
    capacity = int(policy.budget * context_length) if policy.budget <= 1 else int(policy.budget)
    return capacity, policy.sinks, max(1, round(policy.recent * capacity))


def h2o_scores(state: KVState) -> torch.Tensor:
    """Each kept slot's heavy-hitter score, [layers, KV, slots]: its accumulated attention divided
    by the number of rows that attended to it (every committed row from its own on), so a token
    that arrived late is not outscored by one that has simply been seen by more rows."""
    seen = (state.num_committed - state.positions).to(torch.float64)  # >= 1
    return state.scores / seen


def _h2o_keep(state: KVState) -> torch.Tensor:
    """In each lane: all but the ``evict_tokens`` lowest-scored slots between the first
    ``keep_first`` (sinks) and the recent window."""
    lo, hi, m = state.keep_first, state.num_kept - state.recent, state.num_kept
    scores = h2o_scores(state)[..., lo:hi]
    # the lowest scores first, the older first on a tie (a stable sort of equal scores)
    dropped = lo + torch.sort(scores, dim=-1, stable=True).indices[..., : state.evict_tokens]
    kept = torch.ones(*scores.shape[:2], m, dtype=torch.bool).scatter_(-1, dropped, False)
    return torch.arange(m).expand_as(kept)[kept].view(*kept.shape[:2], m - state.evict_tokens)


@dataclass(frozen=True)
class Rule:
    """One policy: its arguments (KVPolicy fields, in order), its size (capacity, slots always kept,
    recent slots always kept; None: the full cache), and the slots it keeps when full."""

    syntax: str
    arguments: tuple[tuple[str, Callable[[str], object]], ...] = ()
    size: Callable[[KVPolicy, int], tuple[int, int, int]] | None = None
    keep: Callable[[KVState], torch.Tensor] | None = None
    wants_attention: bool = False  # H2O: the rows' attention is computed (AttentionObserver)
    uses_prefix_cache: bool = True
    evict_tokens: int | None = None  # tokens dropped at each eviction when not given (None: one block)


RULES: dict[str, Rule] = {
    "full": Rule("full"),
    "sinks": Rule("sinks[:S[,W]]", (("sinks", int), ("window", int)), _sinks_size, _sinks_keep),
    "h2o": Rule(
        "h2o[:BUDGET[,RECENT[,SINKS[,EVICT]]]]",
        (("budget", float), ("recent", float), ("sinks", int), ("evict_tokens", int)),
        _h2o_size,
        _h2o_keep,
        wants_attention=True,
        uses_prefix_cache=False,  # its scores need every prompt row's attention
        evict_tokens=DEFAULT_H2O_EVICT,
    ),
}
KV_POLICIES = tuple(RULES)


def compact(executor, cache: PagedKVCache, table: BlockTable, keep: torch.Tensor | Sequence[int]) -> None:
    """Move the kept slots ``keep`` (ascending; [kept], or [layers, KV, kept] for a set per lane)
    to slots 0 .. kept - 1, re-rotating each key by its move (``executor.move_kv``), and free the
    blocks no longer needed. A block another holder may read (``BlockPool.is_shared``) is not
    written: its rows go to a fresh block."""
    keep = torch.as_tensor(keep, dtype=torch.long)
    keep = keep.view(1, 1, -1) if keep.dim() == 1 else keep
    pool, B, m = cache.pool, cache.pool.block_size, keep.shape[-1]
    moved = (keep != torch.arange(m)).any(dim=(0, 1)).nonzero()
    first = int(moved[0]) if len(moved) else m  # slots before it stay put in every lane
    lo, blocks_kept = (first // B) * B, pool.blocks_for(m)
    new_blocks, replaced = list(table.blocks[:blocks_kept]), []
    for b in range(lo // B, blocks_kept):
        if pool.is_shared(new_blocks[b]):
            replaced.append(new_blocks[b])
            new_blocks[b] = pool.allocate(1)[0]
    if lo < m:
        old, new = torch.as_tensor(list(table.blocks), dtype=torch.long), torch.as_tensor(new_blocks, dtype=torch.long)
        j = torch.arange(lo, m)
        s = keep[..., lo:]  # [lanes, lanes, moves]: each lane's source slot of destination slot j
        src = torch.stack([old[s // B], s % B], dim=-1).reshape(-1, 2)
        dst = torch.stack([new[j // B], j % B], dim=-1).expand(*s.shape, 2).reshape(-1, 2)
        shift = (j - s).reshape(-1)
        if keep.shape[:2] == (1, 1):
            executor.move_kv(cache, src, dst, shift)  # one set: every layer and head moves alike
        else:
            layer, head = torch.meshgrid(torch.arange(keep.shape[0]), torch.arange(keep.shape[1]), indexing="ij")
            lanes = torch.stack([layer, head], dim=-1)[:, :, None].expand(*s.shape, 2).reshape(-1, 2)
            executor.move_kv(cache, src, dst, shift, lanes=lanes)
    pool.free([*table.blocks[blocks_kept:], *replaced])
    table.blocks = new_blocks
    table.num_registered = min(table.num_registered, lo // B)


def make_room(executor, cache: PagedKVCache, table: BlockTable, state: KVState, num_computed: int) -> None:
    """Evict before a pass when the request's cache is full (from committed tokens only)."""
    state.sync(num_computed)
    if state.room() > 0:
        return
    keep = state.keep()
    compact(executor, cache, table, keep)
    state.evicted(keep)
