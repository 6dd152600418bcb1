"""The engine core: requests in, one forward pass a step, what each request gained out.

``add_request`` queues a request; each ``step`` admits waiting requests, drafts for the
decoding ones, schedules every running request's rows (a prompt chunk, or the last token
plus a draft) into one forward pass over ragged rows, verifies each request's rows and
emits what it gained. The components it holds, each owning its state:

* ``scheduler`` (``Scheduler``): the waiting and running queues, the KV cache, the row budget;
* ``planner`` (``DraftPlanner``): the drafter, draft lengths and alternative paths, and
  the batch draft policy they learn in;
* ``output_processor`` (``OutputProcessor``): emitting, stopping, results and outboxes.

Per-request state lives in the ``Request``.

Cache invariant, per request: before a decode step the cache holds every context token
but the last, which is fed together with the draft (k + 1 rows); afterwards
``num_computed`` covers the context plus the accepted draft tokens, leaving the bonus
token as the new last, unfed token. Rejected positions are simply overwritten by the
next pass.

Batch invariance: a request's tokens are bit-identical whatever else is in the batch and
however its prompt is chunked, greedy or seeded sampling. The target's rows are
row-invariant (``Executor.forward_batch``) and sampling randomness is keyed by position
(``fastdecode.engine.request``).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fastdecode.backends import make_target
from fastdecode.backends.base import BatchEntry, Executor
from fastdecode.decoding.detokenize import IncrementalDetokenizer
from fastdecode.decoding.logits_process import LogitsProcessor, processor_for
from fastdecode.decoding.metrics import AcceptanceStats, GenerationResult
from fastdecode.decoding.structured import GrammarMatcher, ll_tokenizer
from fastdecode.decoding.tokenization import encode_prompt
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.engine.config import AdaptiveK, GenerationConfig
from fastdecode.engine.frontends import GenerationStream
from fastdecode.engine.frontends import generate as generate_text
from fastdecode.engine.frontends import stream as stream_steps
from fastdecode.engine.logprobs import first_token, token_logprobs
from fastdecode.engine.output import OutputProcessor, eos_ids
from fastdecode.engine.planning import DraftPlanner, check_lossless_target
from fastdecode.engine.policy import BatchDraftPolicy
from fastdecode.engine.request import Request, RequestOutput, Status
from fastdecode.engine.scheduler import Scheduler, check_limits
from fastdecode.engine.tree import Node, add_branches, branch_logits, keep_path, tree_nodes
from fastdecode.engine.verifier import sample, verify_draft
from fastdecode.errors import ConfigError, FastDecodeError
from fastdecode.kernels.threads import adapt_threads
from fastdecode.kv.cache import BlockPool, PagedKVCache


def _config_error(config) -> ConfigError:
    return ConfigError(f"config must be a GenerationConfig (or pass options as keywords), got {type(config).__name__}")


class Engine:
    """Generation with an optional drafter over a target model, for many requests at once.

    ``Engine(model, tokenizer)`` decodes plainly; ``Engine(model, tokenizer,
    drafter=build_drafter("ngram"))`` decodes speculatively with identical
    greedy output and the same sampling distribution. ``max_num_seqs`` requests
    run at once (continuous batching, on the native backend; the transformers
    backend runs one at a time, the others wait); ``kv_cache_gb`` or
    ``num_kv_blocks`` bound the KV cache: a request holds the blocks of its tokens,
    and when they run out the most recently admitted request is preempted, to resume
    with the same tokens (``fastdecode.engine.scheduler``). ``time_slice_tokens`` S shares the
    running slots: once a running request has generated S tokens since it was admitted, a new
    request waiting for a slot takes its slot, and it resumes later with the same tokens (None,
    the default: first come, first served; ``fastdecode serve`` sets 32).
    """

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
        time_slice_tokens: int | None = None,
    ) -> None:
        check_limits(
            max_num_seqs,
            max_num_batched_tokens,
            long_prefill_token_threshold,
            kv_cache_gb,
            num_kv_blocks,
            block_size,
            time_slice_tokens,
        )
        if drafter is not None and not isinstance(drafter, Drafter):
            raise ConfigError(
                f"drafter must be a Drafter (e.g. build_drafter({drafter!r})) or None, got {drafter!r}"
                if isinstance(drafter, str)
                else f"drafter must be a Drafter or None, got {drafter!r}"
            )
        if config is not None and not isinstance(config, GenerationConfig):
            raise _config_error(config)
        self.model = model
        self.config = config or GenerationConfig()  # defaults for every request
        self.tokenizer = tokenizer
        self.target = target if target is not None else make_target(model)
        self.eos_token_ids = eos_ids(model, tokenizer)
        if drafter is not None:
            check_lossless_target(self.target, model)
            drafter.check_target(tokenizer, self.target.vocab_size)
        self.batched = self.target.batched
        if not self.config.kv_policy.is_full and self.target.kv_policy_unsupported() is not None:
            raise ConfigError(f"kv_policy {self.config.kv_policy.name}: {self.target.kv_policy_unsupported()}")
        self.scheduler = Scheduler(
            self.target,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            kv_cache_gb=kv_cache_gb,
            num_kv_blocks=num_kv_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            time_slice_tokens=time_slice_tokens,
        )
        self.planner = DraftPlanner(drafter, self.target)
        self.output_processor = OutputProcessor(self.eos_token_ids, self.target.context_length)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._ll_tokenizer = None  # the grammar library's view of the tokenizer, built on the first grammar

    # -- what the components own, read through the engine -----------------------------
    @property
    def drafter(self) -> Drafter | None:
        """The prototype: each request drafts with it or its own fork (``Drafter.fork``)."""
        return self.planner.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        self.planner.drafter = drafter

    @property
    def drafter_name(self) -> str:
        return self.planner.drafter_name

    @property
    def policy(self) -> BatchDraftPolicy:
        return self.planner.policy

    @policy.setter
    def policy(self, policy: BatchDraftPolicy) -> None:
        self.planner.policy = policy

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    @property
    def long_prefill_token_threshold(self) -> int | None:
        return self.scheduler.long_prefill_token_threshold

    @property
    def time_slice_tokens(self) -> int | None:
        return self.scheduler.time_slice_tokens

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self.scheduler.enable_prefix_caching

    @property
    def kv_cache(self) -> PagedKVCache | None:
        """None until the first request (``free_kv_cache`` gives it back)."""
        return self.scheduler.kv_cache

    @property
    def block_pool(self) -> BlockPool:
        return self.scheduler.cache().pool

    def _cache(self) -> PagedKVCache:
        return self.scheduler.cache()

    @property
    def _running(self) -> list[Request]:
        return self.scheduler.running

    def free_kv_cache(self) -> None:
        """Give the KV cache's memory back (no request may be running)."""
        if self.has_unfinished():
            raise RuntimeError("free_kv_cache with requests still running")
        self.scheduler.kv_cache = None
        self.target.release()

    # -- requests ----------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int], chat: bool | None = None) -> list[int]:
        """Token ids for ``prompt``; with ``chat`` (default: when the tokenizer
        has a chat template) the prompt becomes one user message."""
        return encode_prompt(self.tokenizer, prompt, self.target.vocab_size, chat)

    def add_request(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        chat: bool | None = None,
        request_id: str | None = None,
        drafter: Drafter | None | str = "engine",
        **options,
    ) -> str:
        """Queue a request; returns its id. Options as :meth:`GenerationConfig.from_options`.
        ``drafter``: "engine" (the engine's drafter, or a fork of it), None (plain decoding), or
        a Drafter object this request alone drafts with until it ends."""
        spec = dict(prompt=prompt, config=config, chat=chat, request_id=request_id, drafter=drafter, **options)
        return self.add_requests([spec])[0]

    def add_requests(self, requests: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None) -> list[str]:
        """Queue several requests, all or none; returns their ids. Each mapping holds ``prompt`` and
        :meth:`add_request`'s other keywords. Every request is checked before any is queued, so a
        bad one leaves the engine as it found it; its error names it (``names[i]``, default
        "request i", where there are several)."""
        t_arrival = time.perf_counter()
        prepared: list[Request] = []
        for i, spec in enumerate(requests):
            try:
                request = self._prepare(t_arrival, **spec)
                given = [r.request_id for r in prepared if r.request_id is not None]
                if request.request_id is not None and request.request_id in given:
                    raise ConfigError(f"request id {request.request_id!r} is given twice")
                if request.drafter is not None and any(r.drafter is request.drafter for r in prepared):
                    raise ConfigError("one drafter object is given to two requests: give each request its own")
            except FastDecodeError as exc:
                if len(requests) == 1 and names is None:
                    raise
                name = names[i] if names is not None else f"request {i}"
                raise type(exc)(f"{name}: {exc}") from None
            prepared.append(request)
        for request in prepared:
            if request.request_id is None:
                request.request_id = next(i for i in map(str, self._ids) if i not in self._requests)
            self._requests[request.request_id] = request
            self.scheduler.waiting.append(request)
        return [r.request_id for r in prepared]

    def _prepare(
        self,
        t_arrival: float,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        chat: bool | None = None,
        request_id: str | None = None,
        drafter: Drafter | None | str = "engine",
        **options,
    ) -> Request:
        """A checked request, not yet queued (its id None when the engine is to choose one)."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise _config_error(config)
        config = GenerationConfig.from_options(config or self.config, **options)
        prompt_ids = self.encode(prompt, chat)
        kv = config.kv_policy.new_state(self.target.context_length, self.scheduler.block_size)
        max_blocks = self.scheduler.max_blocks(prompt_ids, config.max_new_tokens, kv)
        if request_id is not None and str(request_id) in self._requests:
            raise ConfigError(f"request id {str(request_id)!r} is already in use")
        request = self._new_request(request_id, prompt_ids, config, t_arrival, drafter, max_blocks)
        request.request_id = None if request_id is None else str(request_id)
        request.kv = kv
        return request

    def _new_request(
        self,
        request_id: str | None,
        prompt_ids: list[int],
        config: GenerationConfig,
        t_arrival: float,
        drafter: Drafter | None | str,
        max_blocks: int,
    ) -> Request:
        params = config.sampling
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        own_drafter = self._own_drafter(drafter)
        use_drafter = config.speculate and (
            own_drafter is not None or (drafter == "engine" and self.drafter is not None)
        )
        drafter_name = own_drafter.name if own_drafter is not None else self.drafter_name
        k_max = config.max_draft_k or 2 * config.draft_k
        sequential = None
        if not params.greedy:
            sequential = torch.Generator(device=self.target.device)
            sequential.manual_seed(seed)
        return Request(
            request_id=request_id,
            prompt_ids=prompt_ids,
            config=config,
            seed=seed,
            t_arrival=t_arrival,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, prompt_ids, config.stop, min_tokens=config.processing.min_tokens
            ),
            drafter=own_drafter if use_drafter else None,
            drafter_name=drafter_name if use_drafter else "none",
            k_policy=AdaptiveK(config.draft_k, k_max, config.adaptive_k),
            stats=(
                AcceptanceStats(draft_k=config.draft_k, prior_rate=self.planner.prior_rate(drafter_name))
                if use_drafter
                else None
            ),
            sequential_generator=sequential,
            max_blocks=max_blocks,
            processor=self._processor(config, prompt_ids),
        )

    def _processor(self, config: GenerationConfig, prompt_ids: list[int]) -> LogitsProcessor | None:
        """A request's logits processors, with its own grammar state; None when it sets none."""
        params = config.processing
        if not params.active:
            return None
        matcher = None
        if params.grammar is not None:
            if self._ll_tokenizer is None:  # built once (a second or so for a real vocabulary)
                self._ll_tokenizer = ll_tokenizer(self.tokenizer, self.target.vocab_size, self.eos_token_ids)
            matcher = GrammarMatcher(params.grammar, self._ll_tokenizer)
        return LogitsProcessor(params, prompt_ids, self.eos_token_ids, self.target.vocab_size, matcher)

    def _own_drafter(self, drafter: Drafter | None | str) -> Drafter | None:
        """A request's own drafter object, checked; None for "engine" or None."""
        if isinstance(drafter, Drafter):
            check_lossless_target(self.target, self.model)
            drafter.check_target(self.tokenizer, self.target.vocab_size)
            queued = itertools.chain(self.scheduler.waiting, self.scheduler.running)
            if any(r.drafter is drafter for r in queued):
                raise ConfigError("this drafter object already drafts for another request: give each request its own")
            return drafter
        if drafter is not None and drafter != "engine":
            raise ConfigError(f"drafter must be 'engine', None or a Drafter, got {drafter!r}")
        return None

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (an unknown or finished id is ignored)."""
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return
        self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def get_request(self, request_id: str) -> Request:
        return self._requests[request_id]

    # -- the step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one forward pass for the running requests (admitting waiting ones
        first); returns what each request gained, finished ones included.

        admit -> propose drafts -> schedule rows -> forward -> verify and emit -> record -> finish
        """
        # each decoding request's next token first (preempting the newest when the pool runs out), then admission
        self.scheduler.grow(self.planner.fixed_draft)
        self.scheduler.admit(begin=self._begin_drafting)
        if not self.scheduler.running:
            return []
        adapt_threads()  # the kernels' thread count follows the free cores (fastdecode.kernels.threads)
        self.scheduler.make_room()  # KV policies evict from full caches, before anything is drafted
        self.policy.steps += 1
        decoding = [r for r in self.scheduler.running if not r.prefilling]
        t_draft = time.perf_counter()
        # the row budget: each decoding request's last token first, then the drafts, then prompt chunks
        budget = self.scheduler.max_num_batched_tokens - len(decoding)
        drafts, budget, num_proposed = self.planner.propose(decoding, budget, self.scheduler)
        t_forward = time.perf_counter()
        entries, scheduled = self.scheduler.schedule(drafts, budget, bool(decoding))
        path_rows = add_branches(self.kv_cache, scheduled, drafts, entries)  # alternative paths, after every main entry
        self.target.take_experts_run()  # (a drafter running the target's layers counts none of the pass's)
        logits = self.target.forward_batch(self.kv_cache, entries)  # [sum of num_logits, vocab_size]
        experts_run = self.target.take_experts_run()  # a MoE's distinct experts this pass (None: dense)
        t_verify = time.perf_counter()
        outputs = self._verify_and_emit(scheduled, entries, drafts, path_rows, logits)
        self._record(decoding, entries, num_proposed, t_draft, t_forward, t_verify, experts_run)
        self._finish_and_deliver(outputs)
        return outputs

    def _begin_drafting(self, request: Request) -> None:
        self.planner.begin(request, self.scheduler.cache())

    def _verify_and_emit(
        self,
        scheduled: list[Request],
        entries: list[BatchEntry],
        drafts: dict[str, Draft],
        path_rows: dict[str, list[list[Node]]],
        logits: torch.Tensor,
    ) -> list[RequestOutput]:
        """Each scheduled request's output from its rows of ``logits``: a prompt's first token
        after its last chunk, or a draft's verification."""
        first_logit = list(itertools.accumulate((e.num_logits for e in entries), initial=0))  # each entry's first row
        outputs = []
        for e, (request, entry) in enumerate(zip(scheduled, entries)):
            rows = logits[first_logit[e] : first_logit[e] + entry.num_logits]
            if request.prefilling:
                start = request.num_computed  # the chunk's first position (entry.start is a slot under a KV policy)
                request.num_computed += len(entry.shared) + len(entry.token_ids)
                if request.config.prompt_logprobs is not None and not request.has_tokens:
                    if entry.shared:  # rows an earlier entry computed for this prompt too (Scheduler._shared_prefix)
                        index = torch.tensor([first_logit[src] + i for src, i in entry.shared], device=logits.device)
                        rows = torch.cat((logits[index], rows))
                    self._score_prompt(request, start, rows)
                if request.num_computed == len(request.prompt_ids) and not request.has_tokens:
                    outputs.append(self._first_token(request, rows[-1:]))
            else:
                branches = branch_logits(path_rows.get(request.request_id, []), entries, first_logit, logits)
                outputs.append(self._verify(request, drafts[request.request_id], rows, branches))
            self.scheduler.commit(request)
        return outputs

    def _record(
        self,
        decoding: list[Request],
        entries: list[BatchEntry],
        num_proposed: int,
        t_draft: float,
        t_forward: float,
        t_verify: float,
        experts_run: int | None = None,
    ) -> None:
        """A pass's timings: each decoding request's, and the batch draft policy's cost tables (with a
        MoE's distinct experts run)."""
        if not decoding:
            return
        forward_s = time.perf_counter() - t_forward  # verification's int() waited for the device
        for request in decoding:
            request.decode_passes += 1
            request.decode_pass_s += t_verify - t_forward
        num_rows = sum(len(e.token_ids) for e in entries)
        self.planner.record_pass(decoding, num_rows, forward_s, num_proposed, t_forward - t_draft, experts_run)

    def _finish_and_deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._finish(self._requests[out.request_id], out.finish_reason, output=out)
        self.output_processor.deliver(outputs)

    def _score_prompt(self, request: Request, start: int, rows: torch.Tensor) -> None:
        """Prompt log-probabilities from a chunk's rows (row j scores the prompt token after position start + j)."""
        if start == 0:
            request.prompt_logprobs.append(first_token(self.tokenizer, request.prompt_ids[0]))
        scored = request.prompt_ids[start + 1 : start + len(rows) + 1]
        request.prompt_logprobs.extend(
            token_logprobs(self.tokenizer, rows, scored, request.config.prompt_logprobs or 0)
        )

    def _add_logprobs(self, request: Request, logits: torch.Tensor, taken: list[int]) -> None:
        """The taken tokens' log-probabilities (logits: their rows in order, processed as verification saw them)."""
        if request.config.logprobs is not None:
            request.logprobs.extend(token_logprobs(self.tokenizer, logits, taken, request.config.logprobs))

    def _first_token(self, request: Request, logits: torch.Tensor) -> RequestOutput:
        logits = processor_for(request, logits, [])
        token = sample(request, logits[0], len(request.context))
        self.planner.observe_topk(request, [request.context[-1]], logits)
        request.t_first = time.perf_counter()
        taken = self.output_processor.emit(request, [token])
        self._add_logprobs(request, logits, taken)
        if request.processor is not None:
            request.processor.advance(taken)
        return self.output_processor.output(request, taken, 0, 0)

    def _verify(
        self, request: Request, draft: Draft, logits: torch.Tensor, branches: Sequence[tuple[BatchEntry, torch.Tensor]]
    ) -> RequestOutput:
        verdict = verify_draft(request, draft, logits, branches)
        keep_path(self.kv_cache.pool, request, branches, verdict.kept)
        n = verdict.num_accepted
        self.planner.observe_topk(request, [request.context[-1], *verdict.tokens[:n]], verdict.logits)
        appended = [*verdict.tokens[:n], verdict.bonus]
        request.num_computed = len(request.context) + n
        taken = self.output_processor.emit(request, appended)
        self._add_logprobs(request, verdict.logits, taken)
        if request.processor is not None:
            request.processor.advance(taken)
        num_alternative_tokens = tree_nodes(draft)
        self.planner.learn(request, draft, appended, verdict, len(taken), num_alternative_tokens)
        return self.output_processor.output(request, taken, len(draft) + num_alternative_tokens, n)

    def _finish(self, request: Request, reason: str, output: RequestOutput | None = None) -> None:
        request.finish_reason = request.finish_reason or reason
        request.t_end = time.perf_counter()
        self.scheduler.remove(request)
        request.status = Status.FINISHED
        self.planner.finish(request)
        request.result = self.output_processor.result(request)
        if output is not None:
            output.result = request.result
        else:  # an abort: tell the consumer
            self.output_processor.aborted(request)
        del self._requests[request.request_id]

    # -- front ends: loops over add_request / step (fastdecode.engine.frontends) ------------
    def stream(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, chat: bool | None = None, **options
    ) -> GenerationStream:
        return stream_steps(self, prompt, config, chat, **options)

    def generate(
        self,
        prompt: str | Sequence[int] | list,
        config: GenerationConfig | None = None,
        chat: bool | None = None,
        **options,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt -> its GenerationResult; a list of prompts -> their results in
        input order, decoded together by continuous batching."""
        return generate_text(self, prompt, config, chat, **options)
