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
again: ``PROBE_STEPS`` speculative steps of at most ``PROBE_K`` draft tokens each, judged
alone (the text may have turned repetitive; one token tells: the first position is the one
most often accepted, and a request whose first tokens are accepted resumes its full length).
The pause is long enough that a probe's worst-case loss (nothing accepted, so judged after
FAST_VERDICT_STEPS steps, below: FAST_VERDICT_STEPS * (T(rows + PROBE_K) - T(rows) +
drafting)) is at most ``PROBE_LOSS`` of the time the pause decodes plainly, and at least
twice the last one up to ``MAX_PAUSE_STEPS``: n-gram acceptance comes in bursts (a passage
that repeats), and a probe at least every MAX_PAUSE_STEPS steps catches one while costing at
most PROBE_LOSS of the time between probes.

The first verdict comes after ``WARMUP_STEPS`` speculative steps: before it, a request
drafts what the plan gives it (its acceptance prior is its drafter's over earlier requests,
which says little of this prompt). A warm-up or probe whose first ``FAST_VERDICT_STEPS``
steps had no draft token accepted is judged at once. So a prompt whose drafts are never
accepted pays for FAST_VERDICT_STEPS steps of its plan's rows, then for probes of
FAST_VERDICT_STEPS * PROBE_K rows, each after a pause that makes it at most PROBE_LOSS
(counted in rows by tests/engine/test_guard.py: under 3% of a 96-token request's time at
GGUF's row cost, drafts of 3 tokens).

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

    WARMUP_STEPS = 4  # speculative steps before the first verdict
    VERDICT_EVERY = 8  # then a verdict every this many speculative steps, over the latest WINDOW
    WINDOW = 16
    PROBE_STEPS = 4  # speculative steps of a probe after a pause
    FAST_VERDICT_STEPS = 3  # a window of this many steps without one accepted token is judged at once
    PROBE_K = 1  # draft tokens a probe step may carry
    PROBE_LOSS = 0.02  # a probe's worst-case loss, as a fraction of the plain time of the pause before it
    MIN_PAUSE_STEPS = 16
    MAX_PAUSE_STEPS = 64  # the doubling stops here (the loss bound may ask for longer)

    def __init__(self, min_plain_samples: int = 3) -> None:
        self.window: deque[GuardStep] = deque(maxlen=self.WINDOW)
        self.min_plain_samples = min_plain_samples  # plain steps taken to time the plain pass (alone)
        self.verdict_in = self.WARMUP_STEPS  # speculative steps until the next verdict
        self.paused = 0  # decode steps left without drafting
        self.last_pause = 0
        self._timing_plain = False  # the current pause times the plain pass; the window is kept
        self._timed_plain = False  # it paused once to time the plain pass (once is enough)
        self.probing = False  # the window is a probe's: at most PROBE_K draft tokens a step
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
            self.verdict_in, self.probing = self.PROBE_STEPS, True
        return False

    def max_draft(self) -> int | None:
        """The most draft tokens the request may carry this step: 0 while paused, PROBE_K while
        probing, else None (its plan decides). Called once per decode step (it counts the pause)."""
        if not self.drafting():
            return 0
        return self.PROBE_K if self.probing else None

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
        if self.verdict_in > 0 and not self._nothing_accepted():
            return
        self._timing_plain = False
        plain_rows = step.num_rows - step.num_draft_rows
        if alone and not plain_known(plain_rows) and not self._timed_plain:  # plain decoding never timed: time it
            self.paused, self._timing_plain, self._timed_plain = self.min_plain_samples, True, True
            self.verdict_in = 1
            return
        self.verdict(cost)

    def _nothing_accepted(self) -> bool:
        """FAST_VERDICT_STEPS speculative steps or more in the window and not one draft token accepted:
        judged at once (a window is cleared after each pause, so this is the warm-up's or a probe's)."""
        return len(self.window) >= self.FAST_VERDICT_STEPS and all(s.num_tokens <= 1 for s in self.window)

    def verdict(self, cost: Callable[[int], float]) -> bool:
        """Whether the window's steps paid; if not, pause. Returns the verdict."""
        steps = list(self.window)
        n = len(steps)
        tokens = sum(s.num_tokens for s in steps)
        draft_s = median(s.draft_s for s in steps) * n
        spec_s = sum(cost(s.num_rows) for s in steps) + draft_s
        plain_s = sum(cost(s.num_rows - s.num_draft_rows) for s in steps)
        self.verdict_in, self.probing = self.VERDICT_EVERY, False
        # Nothing accepted never pays, whatever the (noisy) cost table says: each step gained the one
        # token a plain step gains, in a pass at least as wide, plus the drafting.
        nothing = all(s.num_tokens <= 1 for s in steps)
        if not nothing and (plain_s <= 0 or tokens * plain_s >= n * spec_s):  # tokens / spec_s >= n / plain_s
            self.last_pause = 0  # (or nothing measured)
            return True
        plain_step_s = plain_s / n
        plain_rows = steps[-1].num_rows - steps[-1].num_draft_rows
        # the next probe at its worst: FAST_VERDICT_STEPS steps of PROBE_K rows, nothing accepted (a probe
        # step that gains a token loses less; one with nothing accepted in as many steps is judged then)
        draft_per_token_s = sum(s.draft_s for s in steps) / max(1, sum(s.num_draft_rows for s in steps))
        probe_step_loss = cost(plain_rows + self.PROBE_K) - cost(plain_rows) + self.PROBE_K * draft_per_token_s
        bounded = self.FAST_VERDICT_STEPS * probe_step_loss / (self.PROBE_LOSS * plain_step_s) if plain_s > 0 else 0
        pause = max(self.MIN_PAUSE_STEPS, min(2 * self.last_pause, self.MAX_PAUSE_STEPS), int(bounded) + 1)
        self.paused = self.last_pause = pause
        self.num_pauses += 1
        return False

    def draft_s_since_last(self, total_draft_s: float) -> float:
        """The request's drafting time since the last call, from its running total."""
        delta = total_draft_s - self._draft_s_seen
        self._draft_s_seen = total_draft_s
        return delta
