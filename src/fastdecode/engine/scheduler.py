"""The scheduler: which requests run, what KV blocks they hold, and which rows each pass feeds.

KV blocks are allocated as a request grows, as vLLM's scheduler does: a request holds the blocks
its tokens occupy (and its current draft's), not its maximum length. *Admission* moves a waiting
request to the running ones when a running slot is free (``max_num_seqs``) and the free blocks
hold its prompt and its first new token; its prompt's leading blocks may come from the prefix
cache. Before each pass every decoding request gets the blocks of its next token, oldest first;
when the pool runs out, the most recently admitted request is *preempted*: its blocks go back to
the pool and it waits at the head of the queue, its tokens kept. Resumed, it recomputes the keys
and values of its context (its full blocks usually still in the prefix cache) and decodes on with
the same tokens as an uninterrupted run: every row of a pass is row-invariant, and sampling is
keyed by position. The oldest requests therefore always finish, and a request that can never fit
the whole cache is refused when it is added.

Running slots are shared by *time slices* (``time_slice_tokens``, S; None: first come, first served).
A request's *turn* is the tokens it has generated since it was last admitted. When every slot is
taken and the request at the head of the queue is *new* (it has generated fewer than S tokens), the
running request with the longest turn, once that turn reaches S, *yields* its slot: it is preempted
as above (the same tokens on resuming), but queued at the back, and the new request takes the slot
(only where the blocks the yield frees let it in). So a request that decodes thousands of tokens
cannot hold slots while new ones wait: a new request waits at most S tokens of a running one's
turn. Nothing starves: a yielded request is no longer new, so it never takes a slot by yielding;
it gets the next slot that frees, in queue order, and is then sure of S tokens (or its end) before
it can yield again. A request under a KV policy never yields (it is never preempted), and a request
never yields to one behind a waiting request that is not new (first come, first served among the
slots that free).

A draft takes only blocks no running request needs this pass: each decoding request's next token
is provided for first, and a draft is cut to the free blocks (``draft_room``). A sampled draft of
fixed length (``DraftPlanner.draft_length_is_fixed``: its tokens depend on its length) is provided
for with the token, so that memory pressure never changes a seeded request's tokens.

A pass has a *row budget* (``max_num_batched_tokens``): each decoding request's last token and draft
come first, then prompt chunks take what is left (*chunked prefill*), a prompt advancing at most
``long_prefill_token_threshold`` rows while others decode.

A request with a KV policy other than ``full`` (``fastdecode.kv.policy``) reserves the blocks of
its policy's capacity when admitted and is never preempted (recomputing its tokens would not give
back what its policy evicted): before each pass ``make_room`` evicts from a full cache, a pass's
rows never cross a full cache (prompt chunks and drafts are cut there), and its rows go to its slots.

The KV cache is allocated on the first request, from ``kv_cache_gb`` or ``num_kv_blocks`` (default:
a full context per running slot within 1 GiB), after checking that the memory is there
(``fastdecode.util.memory``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fastdecode.backends.base import BatchEntry, Executor
from fastdecode.drafters.base import Draft
from fastdecode.engine.request import Request, Status
from fastdecode.errors import ConfigError, PromptTooLongError
from fastdecode.kv.cache import PagedKVCache
from fastdecode.kv.policy import KVState, make_room
from fastdecode.util.memory import available_memory, guarded_allocation


def check_limits(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    long_prefill_token_threshold: int | None,
    kv_cache_gb: float | None,
    num_kv_blocks: int | None,
    block_size: int,
    time_slice_tokens: int | None = None,
) -> None:
    """Refuse batching limits the scheduler cannot honour (before any model is built)."""
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("block_size", block_size),
        ("long_prefill_token_threshold", long_prefill_token_threshold),
        ("time_slice_tokens", time_slice_tokens),
    ):
        if value is None and name in ("long_prefill_token_threshold", "time_slice_tokens"):  # None: no cap
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if kv_cache_gb is not None and num_kv_blocks is not None:
        raise ConfigError("give the KV cache budget once: kv_cache_gb or num_kv_blocks")
    if kv_cache_gb is not None and (
        isinstance(kv_cache_gb, bool) or not isinstance(kv_cache_gb, (int, float)) or not 0 < kv_cache_gb < float("inf")
    ):
        raise ConfigError(f"kv_cache_gb must be a number > 0, got {kv_cache_gb!r}")
    if num_kv_blocks is not None and (
        isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks < 1
    ):
        raise ConfigError(f"num_kv_blocks must be an integer >= 1, got {num_kv_blocks!r}")
    if max_num_batched_tokens < max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})")


class Scheduler:
    """Owns the waiting and running queues and the KV cache (its blocks and its budget)."""

    DEFAULT_KV_CACHE_GB = 1.0

    def __init__(
        self,
        executor: Executor,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int | None,
        kv_cache_gb: float | None,
        num_kv_blocks: int | None,
        block_size: int,
        enable_prefix_caching: bool,
        time_slice_tokens: int | None = None,
    ) -> None:
        self.executor = executor
        batched = executor.batched
        self.max_num_seqs = max_num_seqs if batched else 1
        # S: a running request's turn before a new request may take its slot (None: never; see above).
        # Resuming needs logits-free refill passes, which only a batched executor has.
        self.time_slice_tokens = time_slice_tokens if batched else None
        # Chunked prefill needs logits-free passes, which only a batched executor has.
        self.max_num_batched_tokens = max_num_batched_tokens if batched else 1 << 62
        # While other requests decode, a prompt advances at most this many tokens a step (vLLM's
        # long_prefill_token_threshold): every row of a pass delays every stream in it, and a
        # 256-row chunk of a gguf prefill holds the decoding streams ~0.3 s on 2 cores.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and batched
        self._kv_budget = (kv_cache_gb, num_kv_blocks)
        self.kv_cache: PagedKVCache | None = None  # allocated on the first request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they were admitted
        self.num_preemptions = 0  # preempted for blocks or yielded for a new request (both resume the same)
        self.num_yields = 0  # of those, slots yielded to a new request (time_slice_tokens)

    # -- the KV cache ---------------------------------------------------------------
    def num_blocks(self) -> int:
        gb, blocks = self._kv_budget
        if blocks is not None:
            return blocks
        context_length = self.executor.context_length
        one_context = -(-context_length // self.block_size)
        if not self.executor.batched:
            return one_context
        per_block = self.executor.kv_block_bytes(self.block_size)
        if gb is not None:
            return max(1, int(gb * 2**30 // per_block))
        # Default: a full context for every sequence, within 1 GiB and half the memory left. Blocks are
        # taken as requests grow (and the newest preempted when they run out), so the pool need not hold
        # one whole context: a 128K-token model's would be 28 GiB at 3B; one request longer than the pool
        # is refused with the --kv-cache-gb it would need.
        budget = self.DEFAULT_KV_CACHE_GB * 2**30
        limit = available_memory(self.executor.device)
        if limit is not None:
            budget = min(budget, limit.available_bytes / 2)
        return max(1, min(self.max_num_seqs * one_context, int(budget // per_block)))

    def cache(self) -> PagedKVCache:
        if self.kv_cache is None:
            blocks = self.num_blocks()
            gb, _ = self._kv_budget
            # (the block pool's own books: ~100 bytes a block, beside the tensors)
            nbytes = blocks * (self.executor.kv_block_bytes(self.block_size) + 100)
            what = f"the KV cache ({blocks} blocks of {self.block_size} positions)"
            hint = "lower kv_cache_gb (--kv-cache-gb)" if gb is not None else "lower num_kv_blocks or max_num_seqs"
            with guarded_allocation(nbytes, what, hint, getattr(self.executor, "device", "cpu")):
                self.kv_cache = self.executor.new_kv_cache(blocks, self.block_size, self.enable_prefix_caching)
        return self.kv_cache

    def max_blocks(self, prompt_ids: list[int], max_new_tokens: int, kv: KVState | None = None) -> int:
        """The most blocks a new request can ever hold; refuses one that can never run (one that could
        not fit the whole cache; under a KV policy: its capacity, and the prompt may be longer than
        the context)."""
        context_length = self.executor.context_length
        if kv is not None:
            reason = self.executor.kv_policy_unsupported()
            if reason is not None:
                raise ConfigError(f"kv_policy {kv.policy.name}: {reason}")
        elif len(prompt_ids) >= context_length:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context length is "
                f"{context_length}: no room for a new token"
            )
        pool = self.cache().pool
        limit = kv.capacity if kv is not None else context_length  # a policy's cache never holds more
        needed = pool.blocks_for(min(len(prompt_ids) + max_new_tokens, limit))
        if needed > pool.num_blocks:
            raise ConfigError(
                f"this request may need {needed} KV blocks ({needed * self.block_size} positions) but the KV "
                f"cache has {pool.num_blocks}: raise kv_cache_gb / num_kv_blocks or lower max_new_tokens"
            )
        return needed

    def spare_blocks(self) -> int:
        """Free blocks that no KV-policy request's reservation still counts on."""
        outstanding = sum(r.max_blocks - len(r.table.blocks) for r in self.running if r.kv is not None)
        return self.kv_cache.pool.num_free - outstanding

    def allocate(self, request: Request, positions: int) -> None:
        """Blocks for the request's first ``positions`` positions (the caller checked they are spare)."""
        pool = self.kv_cache.pool
        needed = pool.blocks_for(positions) - len(request.table.blocks)
        if needed > 0:
            request.table.blocks.extend(pool.allocate(needed))

    def draft_room(self, request: Request) -> int:
        """The most draft tokens the request's blocks and the spare ones hold after its last token."""
        if request.kv is not None:  # its reservation holds whatever its policy's cache holds
            return 1 << 30
        held = len(request.table.blocks) * self.block_size
        return max(0, held + max(0, self.spare_blocks()) * self.block_size - len(request.context))

    # -- requests ---------------------------------------------------------------------
    def grow(self, fixed_draft: Callable[[Request], int]) -> None:
        """Before a pass, oldest first: the blocks of each decoding request's next token (and of a
        draft whose length is fixed, ``fixed_draft``); when they are not spare, the most recently
        admitted request is preempted until they are (the request itself, if it is the newest)."""
        pool = self.cache().pool
        for request in list(self.running):
            if request.kv is not None or request.prefilling or request.status is not Status.RUNNING:
                continue
            positions = len(request.context) + fixed_draft(request)
            needed = min(pool.blocks_for(positions), request.max_blocks) - len(request.table.blocks)
            while needed > self.spare_blocks():
                victim = next(r for r in reversed(self.running) if r.kv is None)
                self.preempt(victim)
                if victim is request:
                    break
            else:
                if needed > 0:
                    request.table.blocks.extend(pool.allocate(needed))

    def preempt(self, request: Request, front: bool = True) -> None:
        """Take a running request's blocks back and queue it first (``front``; else last): it resumes
        from its tokens (its full blocks stay in the prefix cache until they are needed)."""
        self.running.remove(request)
        self.kv_cache.pool.free(request.table.blocks)
        request.table.blocks.clear()  # (the same table: a drafter drafting in it holds it)
        request.table.num_registered, request.table.parent_entry = 0, 0
        request.num_computed = 0
        if not request.new_tokens:  # preempted within its prompt: its scores are computed again
            request.prompt_logprobs.clear()
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def admit(self, begin: Callable[[Request], None]) -> None:
        """Move waiting requests to the running ones, first come first served (a preempted request
        first), while a slot and the blocks of their prompt and first new token are free; ``begin``
        starts each new one (its drafter) as it is admitted. While others run, a request is admitted
        only with a block to spare for each of them, or it would be preempted at once as they grow.
        With every slot taken, a new request at the head may take a slot whose turn is over
        (``time_slice_tokens``: the module docstring)."""
        while self.waiting:
            if len(self.running) >= self.max_num_seqs and not self._yield_slot():
                break
            if not self._admit_first(begin):
                break

    def _admit_first(self, begin: Callable[[Request], None]) -> bool:
        """Admit the request at the head of the queue if its blocks are spare; whether it was."""
        pool = self.cache().pool
        request = self.waiting[0]
        kv, fill, first = request.kv, request.fill_ids, request.num_preemptions == 0
        # prompt log-probabilities need every prompt row's logits: no prefix from the cache
        limit = self._max_hit(request) if request.config.prompt_logprobs is None or request.has_tokens else 0
        hit = pool.take_cached_prefix(fill, request.table, limit, count=first)
        needed = self._blocks_to_admit(request) + (len(request.table.blocks) if kv is not None else 0)
        headroom = sum(1 for r in self.running if r.kv is None)
        if self.spare_blocks() - headroom < needed - len(request.table.blocks):
            # wait for running requests to finish (they keep going): give the prefix back,
            # uncounted, so that the prefix cache's hit rate counts each request once
            pool.free(request.table.blocks)
            if first:
                pool.prefix_queries_tokens -= len(fill)
                pool.prefix_hits_tokens -= hit
            request.table.blocks.clear()
            request.table.num_registered, request.table.parent_entry = 0, 0
            return False
        self.waiting.popleft()
        request.num_computed = hit
        request.status = Status.RUNNING
        request.num_tokens_at_admission = len(request.new_tokens)  # its turn starts
        if kv is not None:  # its reservation, of which a policy may copy each shared block it holds
            request.max_blocks = needed
        else:
            self.allocate(request, len(fill) + 1)
        if first:  # (a preempted request keeps its drafter, its guard and its random streams)
            request.num_cached_tokens = hit
            begin(request)
        self.running.append(request)
        return True

    def _blocks_to_admit(self, request: Request) -> int:
        """Blocks a waiting request needs to be admitted, before any prefix-cache hit: under a KV
        policy its reservation, else its prompt's (or refill's) and its first new token's."""
        if request.kv is not None:
            return request.max_blocks
        return min(self.kv_cache.pool.blocks_for(len(request.fill_ids) + 1), request.max_blocks)

    def _yield_slot(self) -> bool:
        """With every slot taken: the running request with the longest turn yields its slot to the new
        request at the head of the queue, if that turn has reached ``time_slice_tokens`` and the
        blocks it frees let the new one in (module docstring). Whether a slot was yielded."""
        S = self.time_slice_tokens
        if S is None or len(self.waiting[0].new_tokens) >= S:
            return False
        turns = [(r.turn_tokens, i) for i, r in enumerate(self.running) if r.kv is None and r.turn_tokens >= S]
        if not turns:
            return False
        _, i = max(turns)  # the longest turn; of equal ones, the most recently admitted
        victim = self.running[i]
        pool = self.kv_cache.pool
        freed = sum(1 for b in victim.table.blocks if pool.ref_count[b] == 1)
        headroom = sum(1 for r in self.running if r.kv is None) - 1
        if self.spare_blocks() + freed - headroom < self._blocks_to_admit(self.waiting[0]):
            return False  # blocks, not slots, hold it back: it waits for them first in line
        self.preempt(victim, front=False)
        self.num_yields += 1
        return True

    @staticmethod
    def _max_hit(request: Request) -> int:
        """Positions the prefix cache may give: all but the prompt's last token (its logits give the
        first token), or a resumed request's whole refill; within a policy's capacity; none for
        H2O, whose scores need every prompt row's attention."""
        kv = request.kv
        if kv is None:
            return len(request.fill_ids) - (0 if request.has_tokens else 1)
        return min(len(request.prompt_ids) - 1, kv.capacity) if kv.policy.uses_prefix_cache else 0

    def make_room(self) -> None:
        """Before a pass: each running request under a KV policy evicts if its cache is full."""
        for request in self.running:
            if request.kv is not None:
                make_room(self.executor, self.kv_cache, request.table, request.kv, request.num_computed)

    def remove(self, request: Request) -> None:
        """Take a finishing request out of its queue and free its blocks."""
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self.running.remove(request)
        self.cache().pool.free(request.table.blocks)
        request.table.blocks = []

    # -- a pass's rows ------------------------------------------------------------------
    def schedule(self, drafts: dict[str, Draft], budget: int, decoding: bool) -> tuple[list[BatchEntry], list[Request]]:
        """One entry per running request, in order: a decoding request's last token and its
        draft, or the next chunk of a prompt within the ``budget`` rows left (``decoding``:
        whether any request decodes, which caps a chunk at ``long_prefill_token_threshold``).
        Returns the entries and the requests they belong to."""
        entries, scheduled = [], []
        prefill_cap = self.long_prefill_token_threshold if decoding and self.long_prefill_token_threshold else budget
        for request in self.running:
            kv = request.kv
            if request.prefilling:
                if budget <= 0:
                    continue
                fill, fresh = request.fill_ids, not request.has_tokens
                shared = self._shared_prefix(request, entries, scheduled) if kv is None and fresh else ()
                start = request.num_computed + len(shared)
                room = kv.room() if kv is not None else budget  # a chunk never crosses a full cache
                chunk = fill[start : start + min(budget, prefill_cap, room)]
                last = start + len(chunk) == len(fill)
                budget -= len(chunk)
                tokens, num_logits = chunk, 1 if last and fresh else 0  # (a refill has its tokens)
                if request.config.prompt_logprobs is not None and fresh:
                    num_logits = len(chunk)  # every row scores the next prompt token
            else:
                draft = drafts[request.request_id]
                start = len(request.context) - 1
                tokens, num_logits, shared = [request.context[-1], *draft.tokens], len(draft) + 1, ()
            attention = None
            if kv is not None:  # rows go to slots; H2O asks for the rows' attention
                start = kv.slot(start)
                kv.pending_start = request.num_computed if request.prefilling else len(request.context) - 1
                kv.pending = []
                attention = kv.pending if kv.wants_attention else None
            self.allocate(request, start + len(tokens))
            entries.append(BatchEntry(tokens, start, request.table.blocks, num_logits, shared, attention))
            scheduled.append(request)
        return entries, scheduled

    def _shared_prefix(
        self, request: Request, entries: list[BatchEntry], scheduled: list[Request]
    ) -> tuple[tuple[int, int], ...]:
        """The prompt positions from ``request.num_computed`` on that an earlier prompt chunk of
        this pass computes with the same tokens before them, as ``BatchEntry.shared`` nodes: the
        pass copies their keys and values instead of computing them again (bit-identical: rows
        are row-invariant). At most all but the prompt's last token, whose row gives the first
        token. A request scoring its prompt shares only rows that have logits. Prompts that
        differ in their last tokens (lm-evaluation-harness's choices after one question, best_of's
        copies of one prompt) thereby compute their common prefix once, at any length (the prefix
        cache shares whole blocks, and only once they are committed)."""
        if not self.executor.batched:
            return ()
        begin, prompt = request.num_computed, request.prompt_ids
        needs_logits = request.config.prompt_logprobs is not None
        best, source = begin, None
        for s, (entry, other) in enumerate(zip(entries, scheduled)):
            end = min(entry.start + len(entry.token_ids), len(prompt) - 1)
            if (
                end <= best
                or not other.prefilling
                or other.has_tokens
                or other.kv is not None
                or entry.start - len(entry.shared) > begin  # its first position this pass, own row or shared
                or (needs_logits and other.config.prompt_logprobs is None)  # its rows and its nodes have logits
            ):
                continue
            j = common_prefix(prompt, other.prompt_ids, end)
            if j > best:
                best, source = j, s
        if source is None:
            return ()
        entry = entries[source]
        first = entry.start - len(entry.shared)
        return tuple(
            entry.shared[p - first] if p < entry.start else (source, p - entry.start) for p in range(begin, best)
        )

    def commit(self, request: Request) -> None:
        """Offer the request's newly filled blocks to the prefix cache; under a KV policy,
        record what the pass committed instead (its blocks are not shared: kv_policy)."""
        if request.kv is not None:
            request.kv.accept(request.num_computed)
            return
        self.kv_cache.pool.register_full_blocks(request.table, request.context, request.num_computed)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``.

    >>> common_prefix([1, 2, 3], [1, 2, 4], 3)
    2
    """
    n = min(limit, len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    j = 0
    while a[j] == b[j]:
        j += 1
    return j
