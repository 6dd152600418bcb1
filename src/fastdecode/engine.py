"""The engine: many requests at once, decoded by continuous batching with
speculative decoding at any batch size.

One loop serves every front end: ``add_request`` queues a request, and each
``step`` schedules the running ones (a prompt chunk, or the last token plus a
draft, per request) into one forward pass over ragged rows, verifies each
request's rows with a pure function (``fastdecode.verify``) and returns what
each request gained. ``generate`` (one prompt or a list), ``stream``, the CLI
and the benchmark are loops over ``add_request`` / ``step``.

Plain decoding is the same loop with an empty draft, so every drafter shares
one code path for stopping, streaming, timing and sampling. The engine owns
the paged KV cache (``fastdecode.kv_cache``); drafters only propose.

Cache invariant, per request: before a decode step the cache holds every
context token but the last, which is fed together with the draft (k + 1
rows); afterwards ``num_computed`` covers the context plus the accepted draft
tokens, leaving the bonus token as the new last, unfed token. Rejected
positions are simply overwritten by the next pass.

Batch invariance: a request's tokens are bit-identical whatever else is in
the batch and however its prompt is chunked, greedy or seeded sampling. The
target's rows are row-invariant (``NativeTarget.forward_batch``) and sampling
randomness is keyed by position (``fastdecode.request``).
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from fastdecode.backends import make_target
from fastdecode.backends.base import BatchEntry, Executor
from fastdecode.detokenize import IncrementalDetokenizer
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.errors import ConfigError, IncompatibleDrafterError, PromptTooLongError
from fastdecode.kv_cache import BlockPool
from fastdecode.metrics import AcceptanceStats, GenerationResult
from fastdecode.request import Request, RequestOutput, Status, position_generator
from fastdecode.sampling import SamplingParams, probabilities
from fastdecode.verify import verify_by_matching, verify_greedy, verify_sampling


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    draft_k: int = 7  # ANPD's K: tokens drafted per step (the initial value when adaptive)
    adaptive_k: bool = False
    cost_aware_k: bool = False  # choose K each step from measured pass cost and acceptance (BatchDraftPolicy), batch 1 too
    max_draft_k: int | None = None  # upper bound for adaptive K; default 2 * draft_k
    speculate: bool = True  # False: this request decodes plainly even when the engine has a drafter
    # Candidate paths per step: 1 = one chain (ANPD); N > 1 = the chain and up to N - 1 alternative
    # paths verified in the same pass; "auto" = up to AUTO_DRAFT_PATHS, each only while it pays.
    draft_tree: int | str = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.draft_k, bool) or not isinstance(self.draft_k, int) or self.draft_k < 1:
            raise ConfigError(f"draft_k must be an integer >= 1, got {self.draft_k!r}")
        if self.max_draft_k is not None and (isinstance(self.max_draft_k, bool) or not isinstance(self.max_draft_k, int) or self.max_draft_k < self.draft_k):
            raise ConfigError(f"max_draft_k must be an integer >= draft_k ({self.draft_k}), got {self.max_draft_k!r}")
        if self.adaptive_k and self.cost_aware_k:
            raise ConfigError("choose one draft length policy: adaptive_k or cost_aware_k")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
        if not isinstance(self.speculate, bool):
            raise ConfigError(f"speculate must be true or false, got {self.speculate!r}")
        if self.draft_tree != "auto" and (isinstance(self.draft_tree, bool) or not isinstance(self.draft_tree, int)
                                          or self.draft_tree < 1):
            raise ConfigError(f"draft_tree must be 'auto' or an integer >= 1 (paths per step), got {self.draft_tree!r}")

    @classmethod
    def from_options(cls, base: "GenerationConfig | None" = None, **options) -> "GenerationConfig":
        """Build from flat keyword options (``temperature=``, ``draft_k=``, ...);
        an unknown option is an error, never silently dropped."""
        base = base or cls()
        sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
        own_fields = {f.name for f in dataclasses.fields(cls)} - {"sampling"}
        unknown = set(options) - sampling_fields - own_fields
        if unknown:
            raise ConfigError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        sampling = dataclasses.replace(base.sampling, **{k: v for k, v in options.items() if k in sampling_fields})
        return dataclasses.replace(base, sampling=sampling, **{k: v for k, v in options.items() if k in own_fields})


class AdaptiveK:
    """Draft length policy: grow by 2 after a fully accepted draft, shrink by 1
    after a rejection (transformers' heuristic), within [1, k_max]."""

    def __init__(self, k: int, k_max: int, enabled: bool) -> None:
        self.k, self.k_max, self.enabled = k, k_max, enabled

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if not self.enabled or num_drafted == 0:
            return
        if num_accepted == num_drafted:
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, 1)


@dataclass
class Step:
    """What one step of the loop appended for a request (its prefill's first token is a step with no draft)."""

    token_ids: list[int]
    text: str  # newly decodable text (held back while it could be a partial stop string)
    num_drafted: int
    num_accepted: int


class GenerationStream:
    """Iterate for :class:`Step` objects; ``result`` is set once iteration ends."""

    def __init__(self, steps: Iterator[Step]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Step]:
        return self._steps


class BatchDraftPolicy:
    """How many draft tokens each request gets this step, from the measured cost of
    the whole pass and each request's acceptance so far.

    The pass costs T(n) seconds for n rows (measured, an EMA per row count; a
    count never measured is interpolated between the nearest measured ones, or
    extrapolated from the largest, see ``cost``). It plans every batch size, a
    cost-aware request decoding alone included: one table of pass times for the
    engine, and each request's own acceptance counts (``AcceptanceStats``). A
    request whose draft positions 1..j have been accepted with estimated
    probabilities c_1..c_j (each given the earlier ones were accepted, from its own
    history: ``AcceptanceStats.conditional_acceptance``) expects prod_{i<=j} c_i
    more tokens from drafting position j. Starting from
    no drafts, one draft row at a time is given to the request whose next
    position expects the most, up to every request's cap, and the plan is the prefix
    of those rows with the best expected tokens per second of the pass,
    E / (T(rows) + drafting time); each request's own policy (fixed K, adaptive K,
    the context and length limits) caps it. Rows that do not pay for themselves at
    this batch size are not spent (the empty plan is one of those weighed), so
    speculation is never planned slower than plain decoding at the same batch size
    (but for one token in ``EXPLORE_EVERY`` steps a request alone drafts anyway,
    ``Engine._plan_drafts``).

    Why measured, not a fixed cut-off (vLLM's ``speculative_disable_by_batch_size``):
    what an extra row costs depends on the kernel, the hardware and the rows
    already in the pass (docs/benchmarks.md).
    """

    # Alternative paths (draft_tree="auto"): their yield, extra tokens per alternative token, is
    # learned across requests (a property of the drafter, the model and the workload), with a
    # slow decay so that it follows a changing workload; when it says no, one step in
    # EXPLORE_EVERY still tries them, so the estimate cannot freeze. The same exploring steps
    # keep a token past a source cut and give a request alone a token its plan refused.
    ALTERNATIVE_DECAY = 0.995
    EXPLORE_EVERY = 64

    def __init__(self) -> None:
        self.forward_s: dict[int, float] = {}
        self.draft_s_per_token = 0.0
        self.alternative_tokens = 0.0
        self.alternative_extra_tokens = 0.0
        self.steps = 0

    @property
    def exploring(self) -> bool:
        """Whether this step is one of the one in ``EXPLORE_EVERY`` that try what the estimates refuse."""
        return self.steps % self.EXPLORE_EVERY == 0

    def record_alternatives(self, num_tokens: int, num_extra: int) -> None:
        d = self.ALTERNATIVE_DECAY
        self.alternative_tokens = d * self.alternative_tokens + num_tokens
        self.alternative_extra_tokens = d * self.alternative_extra_tokens + num_extra

    @property
    def alternative_rate(self) -> float:
        """Expected extra tokens per alternative draft token (Laplace-smoothed: 1/2 before any)."""
        return (self.alternative_extra_tokens + 1) / (self.alternative_tokens + 2)

    def record_forward(self, num_rows: int, seconds: float) -> None:
        old = self.forward_s.get(num_rows)
        self.forward_s[num_rows] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def record_draft(self, num_drafted: int, seconds: float) -> None:
        if num_drafted:
            per_token = seconds / num_drafted
            first = self.draft_s_per_token == 0.0
            self.draft_s_per_token = per_token if first else 0.8 * self.draft_s_per_token + 0.2 * per_token

    def cost(self, rows: int) -> float:
        """T(rows): measured, else interpolated linearly between the nearest measured counts,
        else extrapolated from the two largest (with one measured count: its cost, optimistic,
        so a larger pass gets tried and measured)."""
        table = self.forward_s
        if rows in table:
            return table[rows]
        if not table:
            return 0.0
        below = [m for m in table if m < rows]
        above = [m for m in table if m > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
        if not below:
            return table[min(above)]
        counts = sorted(table)
        top = counts[-1]
        if len(counts) == 1:
            return table[top]
        prev = counts[-2]
        slope = max(0.0, (table[top] - table[prev]) / (top - prev))
        return table[top] + slope * (rows - top)

    def plan(self, base_rows: int, requests: list[tuple[list[float], int]], made: bool = False,
             max_rows: int | None = None) -> list[int]:
        """requests: (acceptance estimates c_1.., cap) per drafting request; returns each one's k.
        ``made``: the drafts are already made (their drafting time is spent whatever k);
        ``max_rows``: at most this many draft rows in all (the pass's row budget)."""
        draft_s = 0.0 if made else self.draft_s_per_token
        ks = [0] * len(requests)
        if base_rows not in self.forward_s:  # the plain pass at this batch size, never measured: measure it first
            return ks
        expected = float(base_rows)  # every row already in the pass yields (at least) its token
        survive = [1.0] * len(requests)
        rows = base_rows
        best_rate, best_ks = expected / self.cost(rows), list(ks)
        while True:
            best, gain = -1, 0.0
            for i, (c, cap) in enumerate(requests):
                if ks[i] < cap:
                    g = survive[i] * c[ks[i]]
                    if g > gain:
                        best, gain = i, g
            drafted = sum(ks)
            if best < 0 or (max_rows is not None and drafted >= max_rows):
                break
            ks[best] += 1
            survive[best] *= requests[best][0][ks[best] - 1]
            expected += gain
            rows += 1
            # Every length is weighed, not only until the first row that does not pay: measured
            # pass times are noisy and not always increasing in the rows (T(3) > T(4) happens),
            # and stopping at the first dip held a drafter accepted 95% of the time at 2 tokens
            # a step in some runs and 4-5 in others.
            rate = expected / (self.cost(rows) + (drafted + 1) * draft_s)
            if rate > best_rate:
                best_rate, best_ks = rate, list(ks)
        return best_ks


def _trimmed(draft: Draft, k: int, paths: int) -> Draft:
    """The draft within the limits the loop set (a drafter may not overrun them): its chain
    at most k tokens, at most paths - 1 alternatives of at most k tokens, none inside an
    earlier path (it would verify nothing new)."""
    if len(draft) <= k and not draft.alternatives:
        return draft
    alternatives: list[list[int]] = []
    for alt in draft.alternatives[: paths - 1] if draft.q is None and draft.tokens else ():
        alt = list(alt[:k])
        if alt and _tree_prefix(alt, [draft.tokens[:k], *alternatives])[0] < len(alt):
            alternatives.append(alt)
    return Draft(draft.tokens[:k], None if draft.q is None else draft.q[:k], tuple(alternatives),
                 None if draft.sources is None else draft.sources[:k])


def _tree_prefix(path: Sequence[int], earlier: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(j, i): the most leading tokens ``path`` shares with one of the ``earlier`` paths of a
    token tree (all from the same root), and which one (the first on a tie; (0, 0) when none)."""
    best = (0, 0)
    for i, other in enumerate(earlier):
        j = 0
        while j < min(len(path), len(other)) and path[j] == other[j]:
            j += 1
        if j > best[0]:
            best = (j, i)
    return best


def _tree_nodes(draft: Draft) -> int:
    """The nodes a draft's alternative paths add to its main chain (their tokens not on an earlier path)."""
    count, earlier = 0, [draft.tokens]
    for alt in draft.alternatives:
        count += len(alt) - _tree_prefix(alt, earlier)[0]
        earlier.append(alt)
    return count


class Engine:
    """Generation with an optional drafter over a target model, for many requests at once.

    ``Engine(model, tokenizer)`` decodes plainly; ``Engine(model, tokenizer,
    drafter=build_drafter("ngram"))`` decodes speculatively with identical
    greedy output and the same sampling distribution. ``max_num_seqs`` requests
    run at once (continuous batching, on the native backend; the transformers
    backend runs one at a time, the others wait); ``kv_cache_gb`` or
    ``num_kv_blocks`` bound the KV cache, and requests that do not fit wait.
    """

    DEFAULT_KV_CACHE_GB = 1.0

    def __init__(
        self,
        model,
        tokenizer,
        drafter: Drafter | None = None,
        target: Executor | None = None,
        config: GenerationConfig | None = None,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        long_prefill_token_threshold: int | None = None,
        kv_cache_gb: float | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
    ) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("block_size", block_size), ("long_prefill_token_threshold", long_prefill_token_threshold)):
            if value is None and name == "long_prefill_token_threshold":  # None: no cap
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if kv_cache_gb is not None and num_kv_blocks is not None:
            raise ConfigError("give the KV cache budget once: kv_cache_gb or num_kv_blocks")
        if kv_cache_gb is not None and (isinstance(kv_cache_gb, bool) or not isinstance(kv_cache_gb, (int, float))
                                        or not 0 < kv_cache_gb < float("inf")):
            raise ConfigError(f"kv_cache_gb must be a number > 0, got {kv_cache_gb!r}")
        if num_kv_blocks is not None and (isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int)
                                          or num_kv_blocks < 1):
            raise ConfigError(f"num_kv_blocks must be an integer >= 1, got {num_kv_blocks!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise ConfigError(f"drafter must be a Drafter (e.g. build_drafter({drafter!r})) or None, got {drafter!r}"
                              if isinstance(drafter, str) else f"drafter must be a Drafter or None, got {drafter!r}")
        if config is not None and not isinstance(config, GenerationConfig):
            raise ConfigError(f"config must be a GenerationConfig (or pass options as keywords), got {type(config).__name__}")
        self.model = model
        self.config = config or GenerationConfig()  # defaults for every request
        self.tokenizer = tokenizer
        self.drafter = drafter  # the prototype: each request drafts with its own (``Drafter.fork``)
        self.target = target if target is not None else make_target(model)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        if drafter is not None:
            _check_lossless_target(self.target, model)
            drafter.check_target(tokenizer, self.target.vocab_size)
        self.batched = self.target.batched
        self._executor = self.target
        self.max_num_seqs = max_num_seqs if self.batched else 1
        # Chunked prefill needs logits-free passes, which only the batched target has.
        self.max_num_batched_tokens = max_num_batched_tokens if self.batched else 1 << 62
        # While other requests decode, a prompt advances at most this many tokens a step (vLLM's
        # long_prefill_token_threshold): every row of a pass delays every stream in it, and a
        # 256-row chunk of a gguf prefill holds the decoding streams ~0.3 s on 2 cores.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching and self.batched
        self._kv_budget = (kv_cache_gb, num_kv_blocks)
        self.kv_cache = None  # allocated on the first request (free_kv_cache() gives it back)
        self.policy = BatchDraftPolicy()
        # per drafter name: [accepted, reached] over finished requests (AcceptanceStats): the prior a
        # new request's acceptance estimates start from, like the cost tables, a property of the
        # drafter, the model and the workload rather than of one prompt
        self._acceptance_totals: dict[str, list[int]] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._outbox: dict[str, deque[RequestOutput]] = {}  # outputs kept for generate / stream consumers
        self._ids = itertools.count()
        self._drafter_in_use = False  # whether a running request drafts with the prototype itself

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    # -- KV cache -------------------------------------------------------------
    def _num_blocks(self) -> int:
        gb, blocks = self._kv_budget
        if blocks is not None:
            return blocks
        one_context = -(-self.target.context_length // self.block_size)
        if not self.batched:
            return one_context
        per_block = self.target.kv_block_bytes(self.block_size)
        if gb is not None:
            return max(1, int(gb * 2**30 // per_block))
        # Default: a full context for every sequence, within 1 GiB (but at least one full context).
        return max(min(self.max_num_seqs * one_context, int(self.DEFAULT_KV_CACHE_GB * 2**30 // per_block)), one_context)

    def _cache(self):
        if self.kv_cache is None:
            self.kv_cache = self._executor.new_kv_cache(self._num_blocks(), self.block_size, self.enable_prefix_caching)
        return self.kv_cache

    def free_kv_cache(self) -> None:
        """Give the KV cache's memory back (no request may be running)."""
        if self.has_unfinished():
            raise RuntimeError("free_kv_cache with requests still running")
        self.kv_cache = None
        self.target.release()

    @property
    def block_pool(self) -> BlockPool:
        return self._cache().pool

    # -- requests -------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool | None = None) -> list[int]:
        """Token ids for ``prompt``; with ``chat`` (default: when the tokenizer
        has a chat template) the prompt becomes one user message."""
        if not isinstance(prompt, str):
            if not isinstance(prompt, Sequence) and not isinstance(prompt, torch.Tensor):
                raise ConfigError(f"the prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
            values = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in values):
                raise ConfigError("token ids must be integers")
            ids = [int(t) for t in values]
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        else:
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ConfigError(f"the prompt is not valid UTF-8 text (character {exc.start}: "
                                  f"{prompt[exc.start]!r})") from None
            has_template = bool(getattr(self.tokenizer, "chat_template", None))
            if chat and not has_template:
                raise ConfigError("this model has no chat template; send raw text (--no-chat)")
            if chat is None:
                chat = has_template
            if chat:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids

    def add_request(self, prompt: str | Sequence[int], config: GenerationConfig | None = None, chat: bool | None = None,
                    request_id: str | None = None, drafter: Drafter | None | str = "engine", **options) -> str:
        """Queue a request; returns its id. Options as :meth:`GenerationConfig.from_options`.
        ``drafter``: "engine" (the engine's drafter, or a fork of it), None (plain decoding), or
        a Drafter object this request alone drafts with until it ends."""
        t_arrival = time.perf_counter()
        if config is not None and not isinstance(config, GenerationConfig):
            raise ConfigError(f"config must be a GenerationConfig (or pass options as keywords), got {type(config).__name__}")
        config = GenerationConfig.from_options(config or self.config, **options)
        prompt_ids = self.encode(prompt, chat)
        context_length = self.target.context_length
        if len(prompt_ids) >= context_length:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context length is "
                f"{context_length}: no room for a new token"
            )
        pool = self._cache().pool
        reserved = pool.blocks_for(min(len(prompt_ids) + config.max_new_tokens, context_length))
        if reserved > pool.num_blocks:
            raise ConfigError(
                f"this request may need {reserved} KV blocks ({reserved * self.block_size} positions) but the KV "
                f"cache has {pool.num_blocks}: raise kv_cache_gb / num_kv_blocks or lower max_new_tokens"
            )
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        params = config.sampling
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        own_drafter = None
        if isinstance(drafter, Drafter):
            _check_lossless_target(self.target, self.model)
            drafter.check_target(self.tokenizer, self.target.vocab_size)
            if any(r.drafter is drafter for r in self._waiting) or any(r.drafter is drafter for r in self._running):
                raise ConfigError("this drafter object already drafts for another request: give each request its own")
            own_drafter = drafter
        elif drafter is not None and drafter != "engine":
            raise ConfigError(f"drafter must be 'engine', None or a Drafter, got {drafter!r}")
        use_drafter = config.speculate and (own_drafter is not None or (drafter == "engine" and self.drafter is not None))
        drafter_name = own_drafter.name if own_drafter is not None else self.drafter_name
        k_max = config.max_draft_k or 2 * config.draft_k
        sequential = None
        if not params.greedy:
            sequential = torch.Generator(device=self.target.device)
            sequential.manual_seed(seed)
        request = Request(
            request_id=request_id, prompt_ids=prompt_ids, config=config, seed=seed, t_arrival=t_arrival,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, config.stop),
            drafter=own_drafter if use_drafter else None, drafter_name=drafter_name if use_drafter else "none",
            k_policy=AdaptiveK(config.draft_k, k_max, config.adaptive_k),
            stats=AcceptanceStats(draft_k=config.draft_k, prior_rate=self._prior_rate(drafter_name)) if use_drafter else None,
            sequential_generator=sequential, reserved_blocks=reserved,
        )
        self._requests[request_id] = request
        self._waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (an unknown or finished id is ignored)."""
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return
        if request.status is Status.WAITING:
            self._waiting.remove(request)
        self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def get_request(self, request_id: str) -> Request:
        return self._requests[request_id]

    # -- the step ---------------------------------------------------------------
    def _admit(self) -> None:
        pool = self._cache().pool
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting[0]
            outstanding = sum(r.reserved_blocks - len(r.table.blocks) for r in self._running)
            hit = pool.take_cached_prefix(request.prompt_ids, request.table, len(request.prompt_ids) - 1)
            if pool.num_free - outstanding < request.reserved_blocks - len(request.table.blocks):
                pool.free(request.table.blocks)  # wait for running requests to finish; running ones keep going
                pool.prefix_queries_tokens -= len(request.prompt_ids)
                pool.prefix_hits_tokens -= hit
                request.table.blocks.clear()
                request.table.num_registered, request.table.parent_entry = 0, 0
                break
            self._waiting.popleft()
            request.num_computed = request.num_cached_tokens = hit
            request.status = Status.RUNNING
            self._begin_drafter(request)
            self._running.append(request)

    def _begin_drafter(self, request: Request) -> None:
        if request.drafter_name == "none":
            return
        if request.drafter is not None:
            pass  # its own
        elif not self._drafter_in_use:  # the prototype drafts for one request at a time; others get a fork
            request.drafter, self._drafter_in_use = self.drafter, True
        else:
            request.drafter = self.drafter.fork()
        params = request.config.sampling
        drafter_generator = None
        if not params.greedy:
            drafter_generator = torch.Generator(device=self.target.device)
            drafter_generator.manual_seed(int(torch.randint(2**62, (1,), generator=request.sequential_generator)))
        request.drafter.set_sampling(params, drafter_generator)
        request.drafts_in_target_kv = request.drafter.attach_kv(self.target, self._cache(), request.table)
        request.drafter.begin(request.prompt_ids)

    def _prior_rate(self, drafter_name: str) -> float:
        """The drafter's conditional acceptance over finished requests, Laplace-smoothed (1/2 before any)."""
        accepted, reached = self._acceptance_totals.get(drafter_name, (0, 0))
        return (accepted + 1) / (reached + 2)

    def _allocate(self, request: Request, positions: int) -> None:
        """Blocks for the request's first ``positions`` positions (within what admission reserved)."""
        pool = self.kv_cache.pool
        needed = pool.blocks_for(positions) - len(request.table.blocks)
        if needed > 0:
            request.table.blocks.extend(pool.allocate(needed))

    def _draft_caps(self, request: Request) -> int:
        config = request.config
        remaining = min(config.max_new_tokens - len(request.new_tokens),
                        self.target.context_length - len(request.context))
        if request.drafter is None:
            return 0
        # cost-aware: up to the cap, the batch policy plans the length (_plan_drafts; a drafter
        # that names its tokens' sources drafts to the cap and is cut after, _cut_by_source). A
        # sampled draft with a q of its own keeps K: its length must not follow measured times,
        # or a seeded request would not reproduce (see _plan_drafts).
        cost_planned = config.cost_aware_k and not self._draft_length_is_fixed(request)
        k = request.k_policy.k_max if cost_planned else request.k_policy.k
        return max(0, min(k, remaining - 1))

    def _plan_drafts(self, decoding: list[Request]) -> list[int]:
        """Each decoding request's draft length this step (see BatchDraftPolicy)."""
        caps = [self._draft_caps(r) for r in decoding]
        # The batch policy applies at batch > 1 (and to cost-aware requests), but never to a sampled
        # request whose drafter has a q of its own: rejection sampling draws from one sequential
        # stream, so its tokens would depend on the batch through its draft lengths.
        free = [i for i, r in enumerate(decoding) if caps[i] > 0 and not self._draft_length_is_fixed(r)
                and not self._cuts_by_source(r, len(decoding))]  # (those draft to the cap and are cut after)
        if len(decoding) == 1 and not decoding[0].config.cost_aware_k:
            return caps
        if not free:
            return caps
        k_max = max(caps)
        plan = self.policy.plan(len(decoding), [(decoding[i].stats.conditional_acceptance(k_max), caps[i]) for i in free])
        # a request decoding alone: one step in EXPLORE_EVERY drafts a token where the plan drafts
        # none, or estimates saying drafting never pays would never be measured again (the text
        # may have turned repetitive since)
        explore = len(decoding) == 1 and self.policy.exploring
        for i, k in zip(free, plan):
            caps[i] = max(k, 1) if explore else k
        return caps

    def _cuts_by_source(self, request: Request, batch: int) -> bool:
        """Whether this request's draft length comes from the cost model and its drafter names
        each token's source: it then drafts to its cap and the draft is cut where the sources'
        acceptance (``AcceptanceStats.source_acceptance``) stops paying for the rows.

        Why after drafting: a token's chance depends on where it came from far more than on
        its position (on SmolLM2's greedy outputs of the suite, 83% of the reached tokens of a
        5-gram match were accepted against 27% of a bigram guess), and an n-gram drafter drafts
        in microseconds. Measured interleaved in one process (docs/benchmarks.md §6d): n-gram
        with --cost-aware-k 1.16x -> 1.24x plain at low bit, 1.24x -> 1.28x in float32."""
        return (request.drafter is not None and request.drafter.reports_sources and request.stats is not None
                and not self._draft_length_is_fixed(request) and (request.config.cost_aware_k or batch > 1))

    def _cut_by_source(self, decoding: list[Request], drafts: dict[str, Draft], cut_ids: set[str],
                       room: int) -> dict[str, int]:
        """The length each draft of the requests ``cut_ids`` (see _cuts_by_source) keeps this
        step, ``room`` draft rows in all."""
        cut = [r for r in decoding if r.request_id in cut_ids and drafts[r.request_id].sources]
        if not cut:
            return {}
        estimates = [[r.stats.source_acceptance(src) for src in drafts[r.request_id].sources] for r in cut]
        others = sum(len(d) for rid, d in drafts.items() if rid not in {r.request_id for r in cut})
        plan = self.policy.plan(len(decoding) + others, [(c, len(c)) for c in estimates], made=True, max_rows=room)
        # one step in EXPLORE_EVERY keeps one token past each cut: a source always cut would never be measured again
        extra = 1 if self.policy.exploring else 0
        return {r.request_id: min(k + extra, len(c)) for r, k, c in zip(cut, plan, estimates)}

    @staticmethod
    def _draft_length_is_fixed(request: Request) -> bool:
        return not request.config.sampling.greedy and getattr(request.drafter, "samples_q", False)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one forward pass for the running requests (admitting waiting ones
        first); returns what each request gained, finished ones included."""
        self._admit()
        if not self._running:
            return []
        self.policy.steps += 1
        pool = self._cache().pool
        budget = self.max_num_batched_tokens
        decoding = [r for r in self._running if not r.prefilling]
        t_draft = time.perf_counter()
        ks = self._plan_drafts(decoding) if decoding else []
        drafts: dict[str, Draft] = {}
        budget -= len(decoding)
        room = budget  # rows left for the drafts, request by request
        cut_later = {r.request_id for r in decoding if self._cuts_by_source(r, len(decoding))}
        for request, k in zip(decoding, ks):
            if not self._draft_length_is_fixed(request) and request.request_id not in cut_later:
                k = min(k, max(0, room))  # (a fixed draft length ignores the budget: see _plan_drafts)
            paths = self._max_paths(request)
            t_propose = time.perf_counter()
            if request.drafts_in_target_kv and k > 0:  # its draft rows go to the request's own blocks
                self._allocate(request, len(request.context) + k)
            if request.drafter is None or k <= 0:
                draft = Draft([])
            elif paths > 1:
                draft = request.drafter.propose_paths(request.context, k, paths)
            else:
                draft = request.drafter.propose(request.context, k)
            request.draft_s += time.perf_counter() - t_propose
            drafts[request.request_id] = _trimmed(draft, k, paths)
            if request.request_id not in cut_later:
                room -= len(drafts[request.request_id])
        proposed = sum(len(d) + _tree_nodes(d) for d in drafts.values())  # what the drafters made (and were timed for)
        cuts = self._cut_by_source(decoding, drafts, cut_later, max(0, room))
        for request in decoding:  # the cut drafts, in order, within the rows the others left
            if request.request_id in cut_later:
                draft = drafts[request.request_id]
                k = min(cuts.get(request.request_id, len(draft)), max(0, room))
                drafts[request.request_id] = _trimmed(draft, k, self._max_paths(request))
                room -= len(drafts[request.request_id])
        budget -= sum(len(d) for d in drafts.values())
        if any(d.alternatives for d in drafts.values()):
            budget = self._admit_alternatives(decoding, drafts, budget)
        t_forward = time.perf_counter()
        entries, scheduled = [], []
        prefill_cap = self.long_prefill_token_threshold if decoding and self.long_prefill_token_threshold else budget
        for request in self._running:
            if request.prefilling:
                if budget <= 0:
                    continue
                start = request.num_computed
                chunk = request.prompt_ids[start : start + min(budget, prefill_cap)]
                last = start + len(chunk) == len(request.prompt_ids)
                budget -= len(chunk)
                tokens, num_logits = chunk, 1 if last else 0
            else:
                draft = drafts[request.request_id]
                start = len(request.context) - 1
                tokens, num_logits = [request.context[-1], *draft.tokens], len(draft) + 1
            self._allocate(request, start + len(tokens))
            entries.append(BatchEntry(tokens, start, request.table.blocks, num_logits))
            scheduled.append(request)
        # each request's alternative paths after all main entries: a token tree, each node computed
        # once (the rows of a path's prefix shared with an earlier path are that path's)
        path_rows: dict[str, list[list[int]]] = {}  # per request, per path: its nodes' (entry, index), root first
        for e, request in enumerate(scheduled):
            draft = None if request.prefilling else drafts[request.request_id]
            if draft is None or not draft.alternatives:
                continue
            paths = [[(e, t) for t in range(len(draft) + 1)]]
            for alt in draft.alternatives:
                j, src = _tree_prefix(alt, [draft.tokens, *draft.alternatives[: len(paths) - 1]])
                branch = self._branch(request, alt, paths[src][: j + 1])
                paths.append([*paths[src][: j + 1], *((len(entries), t) for t in range(len(alt) - j))])
                entries.append(branch)
            path_rows[request.request_id] = paths
        logits = self._executor.forward_batch(self.kv_cache, entries)  # [sum num_logits, vocab_size]
        t_verify = time.perf_counter()
        for request in decoding:
            request.decode_passes += 1
            request.decode_pass_s += t_verify - t_forward
        outputs, row = [], 0
        first_logit = []  # each entry's first logits row (main and branch entries have logits on every row)
        for entry in entries:
            first_logit.append(row)
            row += entry.num_logits
        for e, (request, entry) in enumerate(zip(scheduled, entries)):
            rows = logits[first_logit[e] : first_logit[e] + entry.num_logits]
            if request.prefilling:
                request.num_computed = entry.start + len(entry.token_ids)
                if entry.num_logits:
                    outputs.append(self._first_token(request, rows))
            else:
                draft = drafts[request.request_id]
                branches = []
                for path in path_rows.get(request.request_id, [None])[1:]:
                    index = torch.tensor([first_logit[pe] + t for pe, t in path], device=logits.device)
                    branches.append((entries[path[-1][0]], logits[index]))
                outputs.append(self._verify(request, draft, rows, branches))
            pool.register_full_blocks(request.table, request.context, request.num_computed)
        if decoding:
            forward_s = time.perf_counter() - t_forward  # verification's int() waited for the device
            rows = sum(len(e.token_ids) for e in entries)
            self.policy.record_forward(rows, forward_s)
            self.policy.record_draft(proposed, t_forward - t_draft)
        for out in outputs:
            if out.finished:
                self._finish(self._requests[out.request_id], out.finish_reason, output=out)
        for out in outputs:
            if out.request_id in self._outbox:
                self._outbox[out.request_id].append(out)
        return outputs

    def _sample(self, request: Request, logits: torch.Tensor, position: int) -> int:
        """The target's token at ``position`` from its logits [vocab_size]: argmax, or a draw
        with the position's own generator (``fastdecode.request``)."""
        params = request.config.sampling
        if params.greedy:
            return int(logits.argmax())
        gen = position_generator(request.seed, position, logits.device)
        return int(torch.multinomial(probabilities(logits[None], params)[0], 1, generator=gen))

    def _first_token(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        token = self._sample(request, logits[0], len(request.context))
        width = getattr(request.drafter, "topk_feedback", 0)
        if width:
            request.drafter.observe_topk([request.context[-1]], logits[:1].topk(width, dim=-1).indices.tolist())
        request.t_first = time.perf_counter()
        taken = self._emit(request, [token])
        return self._output(request, taken, 0, 0)

    def _verify(self, request: Request, draft: Draft, logits: torch.Tensor,
                branches: Sequence[tuple[BatchEntry, torch.Tensor]] = ()) -> RequestOutput:
        """Accept a prefix of the draft (and of each alternative path, whose rows and
        logits are in ``branches``); keep the path accepted furthest (the main chain on
        a tie). Every path's accepted prefix is what plain decoding would produce (greedy,
        or sampling keyed by position), so whichever is kept, the output is unchanged."""
        params = request.config.sampling
        first_position = len(request.context)

        def accept(tokens: list[int], rows: torch.Tensor) -> tuple[int, int]:
            if params.greedy:
                return verify_greedy(tokens, rows.argmax(dim=-1))
            return verify_by_matching(tokens, lambda i: self._sample(request, rows[i], first_position + i))

        if params.greedy or draft.q is None:
            n, bonus = accept(draft.tokens, logits)
        else:
            n, bonus = verify_sampling(draft.tokens, probabilities(logits, params), draft.q, request.sequential_generator)
        main_n, kept = n, None
        for (branch, rows), alt in zip(branches, draft.alternatives):
            alt_n, alt_bonus = accept(alt, rows)
            if alt_n > n:
                n, bonus, kept, tokens = alt_n, alt_bonus, branch, alt
        pool = self.kv_cache.pool
        for branch, _ in branches:
            if branch is not kept:
                pool.free(branch.block_table, reuse_first=True)
        if kept is not None:  # the alternative's blocks become the request's (its shared ones are held twice)
            pool.free(request.table.blocks, reuse_first=True)
            request.table.blocks = list(kept.block_table)
        else:
            tokens = draft.tokens
        appended = [*tokens[:n], bonus]
        width = getattr(request.drafter, "topk_feedback", 0)
        if width:
            rows = logits if kept is None else next(r for b, r in branches if b is kept)
            request.drafter.observe_topk([request.context[-1], *tokens[:n]],
                                         rows[: n + 1].topk(width, dim=-1).indices.tolist())
        request.num_computed = len(request.context) + n
        taken = self._emit(request, appended)
        num_alternative_tokens = _tree_nodes(draft)
        if request.drafter is not None:
            request.drafter.observe(appended, n)
            if draft.sources:
                request.stats.record_sources(draft.sources, main_n)
            request.stats.record(len(draft), n, len(taken), num_alternative_tokens, main_n)
            if num_alternative_tokens:
                self.policy.record_alternatives(num_alternative_tokens, n - main_n)
            # the draft-length policies learn from the main chain
            request.k_policy.update(len(draft), main_n)
        return self._output(request, taken, len(draft) + num_alternative_tokens, n)

    # -- alternative paths (a token tree given by its root-to-leaf paths, each node a row once) --
    AUTO_DRAFT_PATHS = 3

    def _max_paths(self, request: Request) -> int:
        tree = request.config.draft_tree
        if tree == 1 or not self.batched or not (request.config.sampling.greedy or not self._draft_length_is_fixed(request)):
            return 1
        return self.AUTO_DRAFT_PATHS if tree == "auto" else tree

    def _admit_alternatives(self, decoding: list[Request], drafts: dict[str, Draft], budget: int) -> int:
        """Keep the alternative paths that fit the row budget, the free KV blocks and, for
        ``draft_tree="auto"``, the cost model: a path costs a row per node not on an earlier
        path (the tree's nodes are computed once) and is expected to add rate * L tokens for
        its L nodes, rate being the extra tokens per alternative node
        (``BatchDraftPolicy.alternative_rate``)."""
        rows = sum(1 + len(drafts[r.request_id]) for r in decoding)
        expected = 0.0
        for r in decoding:
            draft = drafts[r.request_id]
            if r.stats is None or not len(draft):
                expected += 1
                continue
            survive = 1.0
            expected += 1
            for c in r.stats.conditional_acceptance(len(draft)):
                survive *= c
                expected += survive
        pool = self.kv_cache.pool
        spare_blocks = pool.num_free - sum(r.reserved_blocks - len(r.table.blocks) for r in self._running)
        draft_s = self.policy.draft_s_per_token * sum(len(d) for d in drafts.values())
        for r in decoding:
            draft = drafts[r.request_id]
            keep = []
            for alt in draft.alternatives:
                cost_rows = len(alt) - _tree_prefix(alt, [draft.tokens, *keep])[0]  # its nodes not on an earlier path
                start = len(r.context) - 1
                blocks = pool.blocks_for(start + 1 + len(alt)) - start // self.block_size
                if cost_rows > budget or blocks > spare_blocks:
                    break
                if r.config.draft_tree == "auto" and not self.policy.exploring:
                    gain = self.policy.alternative_rate * cost_rows
                    t_now, t_after = self.policy.cost(rows) + draft_s, self.policy.cost(rows + cost_rows) + draft_s
                    # (nothing measured yet at these sizes: try it, and the pass gets measured)
                    if t_now > 0 and expected * t_after >= (expected + gain) * t_now:
                        break
                    expected += gain
                keep.append(alt)
                budget -= cost_rows
                spare_blocks -= blocks
                rows += cost_rows
            draft.alternatives = tuple(keep)
        return budget

    def _branch(self, request: Request, alt: list[int], prefix: list[tuple[int, int]]) -> BatchEntry:
        """A batch entry for an alternative path whose first ``len(prefix)`` nodes (the
        last context token, then ``alt``'s first tokens) are rows of earlier entries,
        ``prefix`` naming them: the request's committed blocks shared, the partly filled
        block holding its last token copied (copy-on-write), fresh blocks after it; the
        pass copies the prefix's keys and values in (``BatchEntry.shared``) and computes
        only the path's own nodes."""
        pool, B = self.kv_cache.pool, self.block_size
        start = len(request.context) - 1
        shared = request.table.blocks[: start // B]
        pool.share(shared)
        private = pool.allocate(pool.blocks_for(start + 1 + len(alt)) - len(shared))
        if start % B:
            self.kv_cache.copy_block(request.table.blocks[start // B], private[0])
        own = alt[len(prefix) - 1 :]
        return BatchEntry(own, start + len(prefix), [*shared, *private], len(own), tuple(prefix))

    def _emit(self, request: Request, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping exactly at EOS, a stop string or a limit."""
        config = request.config
        taken = []
        for tok in tokens:
            request.context.append(tok)
            request.new_tokens.append(tok)
            taken.append(tok)
            reason = None
            if tok in self.eos_token_ids:
                reason = "eos"
            elif request.detokenizer.add([tok]) and config.stop:
                reason = "stop"
            elif len(request.new_tokens) >= config.max_new_tokens:
                reason = "length"
            elif len(request.context) >= self.target.context_length:
                reason = "context"
            if reason:
                request.finish_reason = reason
                break
        return taken

    def _output(self, request: Request, taken: list[int], num_drafted: int, num_accepted: int) -> RequestOutput:
        final = request.finish_reason is not None
        return RequestOutput(request.request_id, taken, request.detokenizer.release(final), final,
                             request.finish_reason, num_drafted, num_accepted)

    def _finish(self, request: Request, reason: str, output: RequestOutput | None = None) -> None:
        request.finish_reason = request.finish_reason or reason
        request.t_end = time.perf_counter()
        if request.status is Status.RUNNING:
            self._running.remove(request)
        request.status = Status.FINISHED
        self._cache().pool.free(request.table.blocks)
        request.table.blocks = []
        if request.drafter is not None:
            request.drafter.finish()
            if request.drafter is self.drafter:
                self._drafter_in_use = False
        if request.stats is not None:
            totals = self._acceptance_totals.setdefault(request.drafter_name, [0, 0])
            accepted, reached = request.stats.conditional_totals()
            totals[0] += accepted
            totals[1] += reached
        request.result = self._result(request)
        if output is not None:
            output.result = request.result
        elif request.request_id in self._outbox:  # an abort: tell the consumer
            self._outbox[request.request_id].append(
                RequestOutput(request.request_id, [], request.detokenizer.release(True), True, request.finish_reason,
                              result=request.result))
        del self._requests[request.request_id]

    def _result(self, request: Request) -> GenerationResult:
        t_first = request.t_first if request.t_first is not None else request.t_end
        decode_s = request.t_end - t_first
        n = len(request.new_tokens)
        return GenerationResult(
            token_ids=list(request.new_tokens),
            text=request.detokenizer.text,
            num_prompt_tokens=len(request.prompt_ids),
            num_new_tokens=n,
            ttft_s=t_first - request.t_arrival,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            wall_s=request.t_end - request.t_arrival,
            finish_reason=request.finish_reason,
            drafter=request.drafter_name,
            acceptance=request.stats,
            num_cached_prompt_tokens=request.num_cached_tokens,
            decode_passes=request.decode_passes,
            decode_pass_s=request.decode_pass_s,
            draft_s=request.draft_s,
        )

    # -- front ends: loops over add_request / step --------------------------------
    def stream(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, chat: bool | None = None, **options
    ) -> GenerationStream:
        request_id = self.add_request(prompt, config, chat, **options)
        self._outbox[request_id] = deque()
        stream = GenerationStream(iter(()))
        stream._steps = self._follow(request_id, stream)
        return stream

    def _follow(self, request_id: str, stream: GenerationStream) -> Iterator[Step]:
        box = self._outbox[request_id]
        try:
            while True:
                while not box:
                    self.step()
                out = box.popleft()
                if out.token_ids or out.text or out.finished:
                    yield Step(out.token_ids, out.text, out.num_drafted, out.num_accepted)
                if out.finished:
                    stream.result = out.result
                    return
        finally:
            self._outbox.pop(request_id, None)
            if stream.result is None:  # the consumer stopped early: free the request
                self.abort(request_id)

    def generate(
        self, prompt: str | Sequence[int] | list, config: GenerationConfig | None = None, chat: bool | None = None,
        **options
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt -> its GenerationResult; a list of prompts -> their results in
        input order, decoded together by continuous batching."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
            ids = [self.add_request(p, config, chat, **options) for p in prompt]
            for request_id in ids:
                self._outbox[request_id] = deque()
            results: dict[str, GenerationResult] = {}
            try:
                while len(results) < len(ids):
                    self.step()
                    for request_id in ids:
                        box = self._outbox.get(request_id)
                        while box:
                            out = box.popleft()
                            if out.finished:
                                results[request_id] = out.result
            finally:
                for request_id in ids:
                    self._outbox.pop(request_id, None)
                    if request_id not in results:
                        self.abort(request_id)
            return [results[i] for i in ids]
        stream = self.stream(prompt, config, chat, **options)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result


def _check_lossless_target(target: Executor, model) -> None:
    """Refuse a target whose verification pass is known not to reproduce its decode steps.

    The native decoder is row-invariant by construction. transformers' forward
    is not: multi-token passes take other kernels than one-token steps. In
    float32 the difference is ~1e-6 and never changed a greedy token in our
    tests and benchmarks; in bf16/fp16 or with low-bit weights (activations cast
    to bf16) it changed most 128-token outputs we measured. Refuse those."""
    if target.name != "hf":
        return
    dtype = next(model.parameters()).dtype
    if target.weights != "float" or dtype != torch.float32:
        raise IncompatibleDrafterError(
            f"speculative decoding on the transformers backend is token-identical only in float32 with float "
            f"weights (this target: {str(dtype).replace('torch.', '')}, {target.weights} weights); "
            "use --backend native (Llama-family models) or float32"
        )


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
