"""Draft planning: which drafter each request drafts with, how long each draft is, which
alternative paths a pass verifies, and what the drafters and the policies learn after.

A request's *cap* is the most it may draft this step: its K (fixed, adaptive, or for a
cost-aware request ``max_draft_k``), within its token and context limits. At batch > 1
(and for a cost-aware request alone) the batch draft policy (``BatchDraftPolicy``) plans
lengths within the caps from measured pass costs. Two kinds of request keep their own
length instead:

* a sampled request whose drafter has a q of its own (*fixed length*): rejection
  sampling draws from one sequential stream, so a length that followed measured times
  would make its tokens depend on the batch;
* a request whose drafter names each token's source (*cut by source*): it drafts to its
  cap and the draft is cut after, where its sources' acceptance stops paying for the rows.

Whatever its length policy, a request's guard (``fastdecode.engine.guard``; not for a fixed
length) checks what its speculation delivered and pauses its drafting while it does not pay.
"""

from __future__ import annotations

import time

import torch

from fastdecode.backends.base import Executor
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.engine.guard import GuardStep, SpeculationGuard
from fastdecode.engine.moe_cost import ExpertsCostModel
from fastdecode.engine.policy import BatchDraftPolicy
from fastdecode.engine.request import Request
from fastdecode.engine.scheduler import Scheduler
from fastdecode.engine.tree import tree_nodes, tree_prefix
from fastdecode.engine.verifier import Verdict
from fastdecode.errors import IncompatibleDrafterError
from fastdecode.kv.cache import PagedKVCache
from fastdecode.loaders.gguf_model import model_dtype


def check_lossless_target(target: Executor, model) -> None:
    """Refuse a target whose verification pass is known not to reproduce its decode steps.

    The native decoder is row-invariant by construction. transformers' forward
    is not: multi-token passes take other kernels than one-token steps. In
    float32 the difference is ~1e-6 and never changed a greedy token in our
    tests and benchmarks; in bf16/fp16 or with low-bit weights (activations cast
    to bf16) it changed most 128-token outputs we measured. Refuse those."""
    if target.name != "hf":
        return
    dtype = model_dtype(model)
    if target.weights != "float" or dtype != torch.float32:
        raise IncompatibleDrafterError(
            f"speculative decoding on the transformers backend is token-identical only in float32 with float "
            f"weights (this target: {str(dtype).replace('torch.', '')}, {target.weights} weights); "
            "use --backend native (the architectures fastdecode.architectures lists) or float32"
        )


def trimmed(draft: Draft, k: int, paths: int) -> Draft:
    """The draft within the limits the loop set (a drafter may not overrun them): its chain
    at most k tokens, at most paths - 1 alternatives of at most k tokens, none inside an
    earlier path (it would verify nothing new)."""
    if len(draft) <= k and not draft.alternatives:
        return draft
    alternatives: list[list[int]] = []
    for alt in draft.alternatives[: paths - 1] if draft.q is None and draft.tokens else ():
        alt = list(alt[:k])
        if alt and tree_prefix(alt, [draft.tokens[:k], *alternatives])[0] < len(alt):
            alternatives.append(alt)
    return Draft(
        draft.tokens[:k],
        None if draft.q is None else draft.q[:k],
        tuple(alternatives),
        None if draft.sources is None else draft.sources[:k],
    )


def grammar_cut(request: Request, draft: Draft) -> Draft:
    """The draft cut at the first token the request's grammar forbids (each alternative path too):
    the target could never accept it, and its rows' masks need a state the grammar allows."""
    if request.processor is None or request.processor.matcher is None or not draft.tokens:
        return draft
    valid = request.processor.valid_prefix
    n = valid(draft.tokens)
    alternatives = tuple(alt[:m] for alt in draft.alternatives if (m := valid(alt)))
    if n == len(draft) and alternatives == draft.alternatives:
        return draft
    if n == 0:
        return Draft([])
    return Draft(
        draft.tokens[:n],
        None if draft.q is None else draft.q[:n],
        alternatives,
        None if draft.sources is None else draft.sources[:n],
    )


class DraftPlanner:
    """Owns the engine's drafter (the *prototype*: each request drafts with it or a fork of
    it, ``Drafter.fork``), the batch draft policy and the acceptance prior of each drafter."""

    AUTO_DRAFT_PATHS = 3  # paths per step for draft_tree="auto"

    def __init__(self, drafter: Drafter | None, target: Executor) -> None:
        self.drafter = drafter
        self.target = target
        self.policy = BatchDraftPolicy()
        profile = target.experts_profile()
        if profile is not None:  # a mixture of experts: its passes are priced by the experts they run
            self.policy.experts = ExpertsCostModel(profile, BatchDraftPolicy.PRIOR_ROW_COST)
        # per drafter name: [accepted, reached] over finished requests (AcceptanceStats): the prior a
        # new request's acceptance estimates start from, like the cost tables, a property of the
        # drafter, the model and the workload rather than of one prompt
        self._acceptance_totals: dict[str, list[int]] = {}
        self._drafter_in_use = False  # whether a running request drafts with the prototype itself

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    # -- a request's drafter, from admission to finish -------------------------------
    def prior_rate(self, drafter_name: str) -> float:
        """The drafter's conditional acceptance over finished requests, Laplace-smoothed (1/2 before any)."""
        accepted, reached = self._acceptance_totals.get(drafter_name, (0, 0))
        return (accepted + 1) / (reached + 2)

    def begin(self, request: Request, cache: PagedKVCache) -> None:
        """Give an admitted request its drafter (its own, the prototype, or a fork) and start it."""
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
        if request.config.speculation_guard and not self.draft_length_is_fixed(request):
            request.guard = SpeculationGuard(self.policy.MIN_SAMPLES)
        # (a KV policy moves the request's rows; a drafter writing at context positions would not follow)
        request.drafts_in_target_kv = request.kv is None and request.drafter.attach_kv(
            self.target, cache, request.table
        )
        request.drafter.begin(request.prompt_ids)

    def finish(self, request: Request) -> None:
        if request.drafter is not None:
            request.drafter.finish()
            if request.drafter is self.drafter:
                self._drafter_in_use = False
        if request.stats is not None:
            totals = self._acceptance_totals.setdefault(request.drafter_name, [0, 0])
            accepted, reached = request.stats.conditional_totals()
            totals[0] += accepted
            totals[1] += reached

    # -- draft lengths ------------------------------------------------------------------
    @staticmethod
    def draft_length_is_fixed(request: Request) -> bool:
        return not request.config.sampling.greedy and request.drafter is not None and request.drafter.samples_q

    def max_paths(self, request: Request) -> int:
        tree = request.config.draft_tree
        if (
            tree == 1
            or request.kv is not None  # a KV policy's slots: one chain (branches copy blocks by position)
            or not self.target.batched
            or not (request.config.sampling.greedy or not self.draft_length_is_fixed(request))
        ):
            return 1
        return self.AUTO_DRAFT_PATHS if tree == "auto" else tree

    def cap(self, request: Request) -> int:
        config = request.config
        kv = request.kv  # a KV policy: the draft stops where its cache is full (it evicts before the next pass)
        limit = self.target.context_length - len(request.context) if kv is None else kv.room()
        remaining = min(config.max_new_tokens - len(request.new_tokens), limit)
        if request.drafter is None:
            return 0
        # cost-aware: up to the cap, the batch policy plans the length (plan; a drafter that
        # names its tokens' sources drafts to the cap and is cut after, cut_by_source). A sampled
        # draft with a q of its own keeps K: its length must not follow measured times, or a
        # seeded request would not reproduce.
        cost_planned = config.cost_aware_k and not self.draft_length_is_fixed(request)
        k = request.k_policy.k_max if cost_planned else request.k_policy.k
        return max(0, min(k, remaining - 1))

    def plan(self, decoding: list[Request]) -> list[int]:
        """Each decoding request's draft length this step (see BatchDraftPolicy); none for a
        request its guard pauses (``fastdecode.engine.guard``)."""
        caps = [self._guarded_cap(r) for r in decoding]
        free = [
            i
            for i, r in enumerate(decoding)
            if caps[i] > 0 and not self.draft_length_is_fixed(r) and not self.cuts_by_source(r, len(decoding))
        ]  # (those draft to the cap and are cut after)
        if len(decoding) == 1 and not decoding[0].config.cost_aware_k:
            return caps
        if not free:
            return caps
        k_max = max(caps)
        plan = self.policy.plan(
            len(decoding), [(decoding[i].stats.conditional_acceptance(k_max), caps[i]) for i in free]
        )
        # a request decoding alone: one step in EXPLORE_EVERY drafts a token where the plan drafts
        # none, or estimates saying drafting never pays would never be measured again (the text
        # may have turned repetitive since)
        explore = len(decoding) == 1 and self.policy.exploring
        for i, k in zip(free, plan):  # (a request its guard pauses is not free: its cap is 0)
            caps[i] = max(k, 1) if explore else k
        return caps

    def _guarded_cap(self, request: Request) -> int:
        """The request's cap within what its guard allows this step (none while paused, PROBE_K while probing)."""
        limit = None if request.guard is None else request.guard.max_draft()
        return self.cap(request) if limit is None else min(limit, self.cap(request))

    def cuts_by_source(self, request: Request, batch: int) -> bool:
        """Whether this request's draft length comes from the cost model and its drafter names
        each token's source: it then drafts to its cap and the draft is cut where the sources'
        acceptance (``AcceptanceStats.source_acceptance``) stops paying for the rows.

        Why after drafting: a token's chance depends on where it came from far more than on
        its position (on SmolLM2's greedy outputs of the suite, 83% of the reached tokens of a
        5-gram match were accepted against 27% of a bigram guess), and an n-gram drafter drafts
        in microseconds. Measured interleaved in one process (docs/benchmarks.md §6d): n-gram
        with --cost-aware-k 1.16x -> 1.24x plain at low bit, 1.24x -> 1.28x in float32."""
        return (
            request.drafter is not None
            and request.drafter.reports_sources
            and request.stats is not None
            and not self.draft_length_is_fixed(request)
            and (request.config.cost_aware_k or batch > 1)
        )

    def cut_by_source(
        self, decoding: list[Request], drafts: dict[str, Draft], cut_ids: set[str], room: int
    ) -> dict[str, int]:
        """The length each draft of the requests ``cut_ids`` (see cuts_by_source) keeps this
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

    # -- the propose stage of a step -------------------------------------------------------
    def propose(self, decoding: list[Request], budget: int, scheduler: Scheduler) -> tuple[dict[str, Draft], int, int]:
        """Each decoding request's draft, within ``budget`` draft rows; returns the drafts (by
        request id), the rows left for prompt chunks and the draft tokens the drafters made."""
        ks = self.plan(decoding) if decoding else []
        drafts: dict[str, Draft] = {}
        room = budget  # rows left for the drafts, request by request
        cut_later = {r.request_id for r in decoding if self.cuts_by_source(r, len(decoding))}
        for request, k in zip(decoding, ks):
            if not self.draft_length_is_fixed(request) and request.request_id not in cut_later:
                k = min(k, max(0, room))  # (a fixed draft length ignores the budget: see plan)
            drafts[request.request_id] = self._draft(request, k, scheduler)
            if request.request_id not in cut_later:
                room -= len(drafts[request.request_id])
        proposed = sum(len(d) + tree_nodes(d) for d in drafts.values())  # what the drafters made (and were timed for)
        cuts = self.cut_by_source(decoding, drafts, cut_later, max(0, room))
        for request in decoding:  # the cut drafts, in order, within the rows the others left
            if request.request_id in cut_later:
                draft = drafts[request.request_id]
                k = min(cuts.get(request.request_id, len(draft)), max(0, room))
                drafts[request.request_id] = trimmed(draft, k, self.max_paths(request))
                room -= len(drafts[request.request_id])
        budget -= sum(len(d) for d in drafts.values())
        if any(d.alternatives for d in drafts.values()):
            budget = self.admit_alternatives(decoding, drafts, budget, scheduler)
        return drafts, budget, proposed

    def fixed_draft(self, request: Request) -> int:
        """The draft a request of fixed draft length makes next (the scheduler provides its blocks
        with the request's next token: its tokens depend on its length); 0 for any other request,
        whose draft takes only the blocks left over (``Scheduler.draft_room``)."""
        return self.cap(request) if self.draft_length_is_fixed(request) else 0

    def _draft(self, request: Request, k: int, scheduler: Scheduler) -> Draft:
        """One request's draft of at most k tokens (and its alternative paths), timed; its blocks are
        taken at once, so that the next request's draft sees what is left."""
        paths = self.max_paths(request)
        k = min(k, scheduler.draft_room(request))
        t_propose = time.perf_counter()
        if request.drafts_in_target_kv and k > 0:  # its draft rows go to the request's own blocks
            scheduler.allocate(request, len(request.context) + k)
        if request.drafter is None or k <= 0:
            draft = Draft([])
        elif paths > 1:
            draft = request.drafter.propose_paths(request.context, k, paths)
        else:
            draft = request.drafter.propose(request.context, k)
        request.draft_s += time.perf_counter() - t_propose
        draft = grammar_cut(request, trimmed(draft, k, paths))
        if request.kv is None:  # (a KV policy's rows go to slots, within its reservation: Scheduler.schedule)
            scheduler.allocate(request, len(request.context) + len(draft))
        return draft

    def admit_alternatives(
        self, decoding: list[Request], drafts: dict[str, Draft], budget: int, scheduler: Scheduler
    ) -> int:
        """Keep the alternative paths that fit the row budget, the free KV blocks and, for
        ``draft_tree="auto"``, the cost model: a path costs a row per node not on an earlier
        path (the tree's nodes are computed once) and is expected to add rate * L tokens for
        its L nodes, rate being the extra tokens per alternative node
        (``BatchDraftPolicy.alternative_rate``). Returns the rows left."""
        rows = sum(1 + len(drafts[r.request_id]) for r in decoding)
        expected = self._expected_tokens(decoding, drafts)
        pool = scheduler.kv_cache.pool
        spare_blocks = scheduler.spare_blocks()
        draft_s = self.policy.draft_s_per_token * sum(len(d) for d in drafts.values())
        for r in decoding:
            draft = drafts[r.request_id]
            keep = []
            for alt in draft.alternatives:
                cost_rows = len(alt) - tree_prefix(alt, [draft.tokens, *keep])[0]  # its nodes not on an earlier path
                start = len(r.context) - 1
                blocks = pool.blocks_for(start + 1 + len(alt)) - start // scheduler.block_size
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

    @staticmethod
    def _expected_tokens(decoding: list[Request], drafts: dict[str, Draft]) -> float:
        """The tokens the requests' main chains are expected to yield: per request its bonus
        token, plus prod_{i<=j} c_i for each draft position j."""
        expected = 0.0
        for r in decoding:
            draft = drafts[r.request_id]
            expected += 1
            if r.stats is None or not len(draft):
                continue
            survive = 1.0
            for c in r.stats.conditional_acceptance(len(draft)):
                survive *= c
                expected += survive
        return expected

    # -- after verification ------------------------------------------------------------
    @staticmethod
    def observe_topk(request: Request, tokens: list[int], logits: torch.Tensor) -> None:
        """Give a drafter that asks for them the target's top candidates after each of
        ``tokens`` (logits: at least one row per token, [>= len(tokens), vocab_size])."""
        width = request.drafter.topk_feedback if request.drafter is not None else 0
        if width:
            request.drafter.observe_topk(tokens, logits[: len(tokens)].topk(width, dim=-1).indices.tolist())

    def learn(
        self,
        request: Request,
        draft: Draft,
        appended: list[int],
        verdict: Verdict,
        num_taken: int,
        num_alternative_tokens: int,
    ) -> None:
        """The drafter, the request's acceptance counts and the draft-length policies learn from a
        verified draft (the length policies from the main chain)."""
        if request.drafter is None:
            return
        n, main_n = verdict.num_accepted, verdict.num_main_accepted
        request.drafter.observe(appended, n)
        if draft.sources:
            request.stats.record_sources(draft.sources, main_n)
        request.stats.record(len(draft), n, num_taken, num_alternative_tokens, main_n)
        if request.guard is not None:
            request.guard.pending = (len(appended), len(draft) + num_alternative_tokens)
        if num_alternative_tokens:
            self.policy.record_alternatives(num_alternative_tokens, n - main_n)
        request.k_policy.update(len(draft), main_n)

    def record_pass(
        self,
        decoding: list[Request],
        num_rows: int,
        forward_s: float,
        num_proposed: int,
        draft_s: float,
        experts_run: int | None = None,
    ) -> None:
        """A decoding pass's measured cost (and a MoE target's distinct experts run) and its drafting
        time, for the batch draft policy; and each decoding request's step, for its guard."""
        self.policy.record_forward(num_rows, forward_s)
        if experts_run is not None and self.policy.experts is not None:
            self.policy.experts.record(num_rows, experts_run)
        self.policy.record_draft(num_proposed, draft_s)
        for request in decoding:
            guard = request.guard
            if guard is None:
                continue
            own_draft_s = guard.draft_s_since_last(request.draft_s)
            if guard.pending is not None and guard.pending[1] > 0:
                tokens, draft_rows = guard.pending
                step = GuardStep(tokens, num_rows, draft_rows, own_draft_s)
                alone = len(decoding) == 1 and num_rows == 1 + draft_rows
                guard.record(step, self.policy.cost, self.policy.known, alone)
            guard.pending = None
