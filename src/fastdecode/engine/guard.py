"""The speculation guard: one request stops drafting while its speculation does not pay.

Terms: a *speculative step* of a request is a decode step in which it verified draft rows;
it *pays* when the tokens it gained per second of its speculative steps are at least what
plain decoding of it would have gained at the same batch: one token per pass without its
draft rows. Both times come from the batch draft policy's pass costs
(``BatchDraftPolicy.cost``: medians of measured timings, so one slow pass decides nothing),
plus the request's own drafting time (median per step). The tokens are the ones it gained.

The plan's estimates (``BatchDraftPolicy.plan``) say what should pay; the guard checks what
did, and covers every draft length policy (fixed K, adaptive K, cost-aware): a translation
prompt whose drafts are mostly wrong, a drafter slower than it was at the last request, a
machine that got busy.

While it does not pay, the request drafts nothing (*paused*), and after the pause it probes
again: ``PROBE_STEPS`` speculative steps, judged alone (the text may have turned
repetitive). The pause is long enough that a probe's expected loss is at most
``PROBE_LOSS`` of the time the pause decodes plainly (the loss measured at the last
verdict), and at least twice the last one: a request whose drafts never pay probes
O(log steps) times.

Which tokens a request gets never depends on the guard: greedy verification and position-keyed
sampling give the same tokens for any draft length. A sampled draft with a q of its own
(``DraftPlanner.draft_length_is_fixed``) keeps its K and has no guard: its tokens would follow
the machine's timing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class GuardStep:
    """One speculative step of a request."""

    num_tokens: int  # tokens it gained (accepted + the bonus token)
    num_rows: int  # rows of the whole pass
    num_draft_rows: int  # of those, its own draft rows (main chain and alternative nodes)
    draft_s: float  # its drafting time


class SpeculationGuard:
    """Per request: whether it drafts this step (:meth:`drafting`), from its speculative steps (:meth:`record`)."""

    WARMUP_STEPS = 8  # speculative steps before the first verdict
    VERDICT_EVERY = 8  # then a verdict every this many speculative steps, over the latest WINDOW
    WINDOW = 16
    PROBE_STEPS = 4  # speculative steps of a probe after a pause
    PROBE_LOSS = 0.02  # a probe's expected loss, as a fraction of the plain time of the pause before it
    MIN_PAUSE_STEPS = 16
    MAX_PAUSE_STEPS = 1024

    def __init__(self, min_plain_samples: int = 3) -> None:
        self.window: deque[GuardStep] = deque(maxlen=self.WINDOW)
        self.min_plain_samples = min_plain_samples  # plain steps taken to time the plain pass (alone)
        self.verdict_in = self.WARMUP_STEPS  # speculative steps until the next verdict
        self.paused = 0  # decode steps left without drafting
        self.last_pause = 0
        self._timing_plain = False  # the current pause times the plain pass; the window is kept
        self._timed_plain = False  # it paused once to time the plain pass (once is enough)
        self.pending: tuple[int, int] | None = None  # (tokens, draft rows) of this step, until its pass is timed
        self._draft_s_seen = 0.0
        self.num_paused_steps = 0  # decode steps it drafted nothing because of the guard
        self.num_pauses = 0

    def drafting(self) -> bool:
        """Whether the request may draft this step (called once per decode step)."""
        if self.paused <= 0:
            return True
        self.paused -= 1
        self.num_paused_steps += 1
        if self.paused == 0 and not self._timing_plain:  # a probe: fresh evidence
            self.window.clear()
            self.verdict_in = self.PROBE_STEPS
        return False

    def record(
        self,
        step: GuardStep,
        cost: Callable[[int], float],
        plain_known: Callable[[int], bool],
        alone: bool,
    ) -> None:
        """After a speculative step: keep it, and judge when a verdict is due. ``cost``: T(rows)
        (``BatchDraftPolicy.cost``); ``plain_known``: whether the pass of this many rows is
        measured; ``alone``: the request decodes alone (its plain pass can be timed by pausing)."""
        self.window.append(step)
        self.verdict_in -= 1
        if self.verdict_in > 0:
            return
        self._timing_plain = False
        plain_rows = step.num_rows - step.num_draft_rows
        if alone and not plain_known(plain_rows) and not self._timed_plain:  # plain decoding never timed: time it
            self.paused, self._timing_plain, self._timed_plain = self.min_plain_samples, True, True
            self.verdict_in = 1
            return
        self.verdict(cost)

    def verdict(self, cost: Callable[[int], float]) -> bool:
        """Whether the window's steps paid; if not, pause. Returns the verdict."""
        steps = list(self.window)
        n = len(steps)
        tokens = sum(s.num_tokens for s in steps)
        draft_s = median(s.draft_s for s in steps) * n
        spec_s = sum(cost(s.num_rows) for s in steps) + draft_s
        plain_s = sum(cost(s.num_rows - s.num_draft_rows) for s in steps)
        self.verdict_in = self.VERDICT_EVERY
        if plain_s <= 0 or tokens * plain_s >= n * spec_s:  # tokens / spec_s >= n / plain_s (or nothing measured)
            self.last_pause = 0
            return True
        plain_step_s = plain_s / n
        loss_per_step = (spec_s - tokens * plain_step_s) / n  # vs plain decoding gaining the same tokens
        bounded = self.PROBE_STEPS * loss_per_step / (self.PROBE_LOSS * plain_step_s)
        pause = max(self.MIN_PAUSE_STEPS, 2 * self.last_pause, int(bounded) + 1)
        self.paused = self.last_pause = min(self.MAX_PAUSE_STEPS, pause)
        self.num_pauses += 1
        return False

    def draft_s_since_last(self, total_draft_s: float) -> float:
        """The request's drafting time since the last call, from its running total."""
        delta = total_draft_s - self._draft_s_seen
        self._draft_s_seen = total_draft_s
        return delta
