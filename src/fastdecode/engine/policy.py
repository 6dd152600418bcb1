"""The batch draft policy: how many draft rows a pass should carry, from measured costs.

A pure cost model (no engine state): a table of measured pass times per row count, the
drafting time per token, and the learned yield of alternative paths. ``DraftPlanner``
(``fastdecode.engine.planning``) asks it each step.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from fastdecode.engine.moe_cost import ExpertsCostModel


class BatchDraftPolicy:
    """How many draft tokens each request gets this step, from the measured cost of
    the whole pass and each request's acceptance so far.

    The pass costs T(n) seconds for n rows (measured: the median of a row count's
    latest timings, trusted from ``MIN_SAMPLES`` on; a count not measured is
    interpolated between the nearest measured ones, or extrapolated from the
    largest, see ``cost``). It plans every batch size, a
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
    ``DraftPlanner.plan``).

    Why measured, not a fixed cut-off (vLLM's ``speculative_disable_by_batch_size``):
    what an extra row costs depends on the kernel, the hardware and the rows
    already in the pass (docs/benchmarks.md).

    A mixture of experts (``experts`` set: ``DraftPlanner`` sets it from the target's
    ``experts_profile``): a row count not measured is priced by ``ExpertsCostModel`` from the
    experts a pass of that many rows is expected to run, not by rows alone; a dense target
    (``experts`` None) is planned exactly as before.
    """

    # Alternative paths (draft_tree="auto"): their yield, extra tokens per alternative token, is
    # learned across requests (a property of the drafter, the model and the workload), with a
    # slow decay so that it follows a changing workload; when it says no, one step in
    # EXPLORE_EVERY still tries them, so the estimate cannot freeze. The same exploring steps
    # keep a token past a source cut and give a request alone a token its plan refused.
    ALTERNATIVE_DECAY = 0.995
    EXPLORE_EVERY = 64

    # Pass times (docs: "a cost model noise cannot fool"). A row count's cost is the median of its
    # latest SAMPLES timings and is trusted only from MIN_SAMPLES on: one slow pass (a page fault, a
    # busy moment, a cold cache on the first request) moves no plan. A sustained shift, the latest
    # SHIFT_RUN timings of a count all off its median by more than SHIFT_RATIO (the machine's load
    # changed), restarts that count from them and scales the timings of every count not timed since
    # the run began by the same ratio: estimates until measured again, rather than a picture of a
    # machine that is gone. (Counts timed during the run keep their own evidence: scaling them
    # would make two counts shifting differently undo each other's shift over and over.)
    SAMPLES = 9
    MIN_SAMPLES = 3
    SHIFT_RUN = 4
    SHIFT_RATIO = 1.3
    # A wider pass than any measured, with one row count known: each extra row is assumed to cost
    # this fraction of the known pass. The first request of a process is planned from it, before
    # any multi-row pass is timed, so it takes the dearest row measured, not the mean: float32's
    # 8-row pass measured 1.75x a 1-row pass (0.11 a row), GGUF's 2.6x after its 1-row kernel got
    # faster (0.23 a row). Its first drafts are short (1-2 tokens at acceptance 1/2) until measured.
    PRIOR_ROW_COST = 0.25

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}  # row count -> its latest pass times (seconds)
        self._table: dict[int, float] | None = None  # forward_s, cached until the next timing
        self._clock = 0  # timings recorded
        self._clocks: dict[int, deque[int]] = {}  # row count -> the clocks of its timings in _samples
        self._draft_samples: deque[float] = deque(maxlen=self.SAMPLES)  # drafting seconds per token
        self.alternative_tokens = 0.0
        self.alternative_extra_tokens = 0.0
        self.steps = 0
        self.shifts = 0  # sustained shifts seen (re-measurements started)
        self.experts: ExpertsCostModel | None = None  # a MoE target's cost by experts run (None: dense)

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

    # -- measured costs ----------------------------------------------------------------
    @property
    def forward_s(self) -> dict[int, float]:
        """The trusted pass times: row count -> median seconds (counts with MIN_SAMPLES timings or more).
        Assigning a dict seeds the table with those costs as if each had been measured MIN_SAMPLES times."""
        if self._table is None:
            self._table = {
                rows: median(times) for rows, times in self._samples.items() if len(times) >= self.MIN_SAMPLES
            }
        return self._table

    @forward_s.setter
    def forward_s(self, table: dict[int, float]) -> None:
        self._samples = {rows: deque([s] * self.MIN_SAMPLES, maxlen=self.SAMPLES) for rows, s in table.items()}
        self._clocks = {rows: deque([self._clock] * self.MIN_SAMPLES, maxlen=self.SAMPLES) for rows in table}
        self._table = None

    def timings(self, rows: int) -> int:
        """How many timings of a pass of ``rows`` rows the table holds."""
        return len(self._samples.get(rows, ()))

    def known(self, rows: int) -> bool:
        """Whether the pass of ``rows`` rows has been timed MIN_SAMPLES times (its cost is trusted)."""
        return self.timings(rows) >= self.MIN_SAMPLES

    def plain_cost_known(self, rows: int) -> bool:
        """Whether T(rows) is measured (MIN_SAMPLES timings) or lies between two measured counts
        (at a batch whose other requests always draft, a pass of exactly ``rows`` rows may never come)."""
        table = self.forward_s
        return rows in table or (any(m < rows for m in table) and any(m > rows for m in table))

    def record_forward(self, num_rows: int, seconds: float) -> None:
        self._clock += 1
        self._clocks.setdefault(num_rows, deque(maxlen=self.SAMPLES)).append(self._clock)
        times = self._samples.setdefault(num_rows, deque(maxlen=self.SAMPLES))
        times.append(seconds)
        self._table = None  # (the medians are computed again when next asked)
        if len(times) >= self.MIN_SAMPLES + self.SHIFT_RUN:
            self._check_shift(num_rows, times)

    def _check_shift(self, num_rows: int, times: deque[float]) -> None:
        """A sustained shift at ``num_rows``: restart it from its latest SHIFT_RUN timings, and scale
        the counts not timed since the run began (stale: load changes every pass alike) by its ratio."""
        run, before = list(times)[-self.SHIFT_RUN :], list(times)[: -self.SHIFT_RUN]
        ref = median(before)
        high, low = all(t > ref * self.SHIFT_RATIO for t in run), all(t * self.SHIFT_RATIO < ref for t in run)
        if ref <= 0 or not (high or low):
            return
        ratio = median(run) / ref
        self.shifts += 1
        times.clear()
        times.extend(run)
        clocks = self._clocks[num_rows]
        run_clocks = list(clocks)[-self.SHIFT_RUN :]
        clocks.clear()
        clocks.extend(run_clocks)
        for rows, other in self._samples.items():
            if rows != num_rows and self._clocks[rows][-1] < run_clocks[0]:
                self._samples[rows] = deque((t * ratio for t in other), maxlen=self.SAMPLES)

    def record_draft(self, num_drafted: int, seconds: float) -> None:
        if num_drafted:
            self._draft_samples.append(seconds / num_drafted)

    @property
    def draft_s_per_token(self) -> float:
        """Drafting seconds per draft token: the median of the latest passes' (0 before any)."""
        return median(self._draft_samples) if self._draft_samples else 0.0

    @draft_s_per_token.setter
    def draft_s_per_token(self, seconds: float) -> None:
        self._draft_samples = deque([seconds], maxlen=self.SAMPLES)

    def cost(self, rows: int) -> float:
        """T(rows) from the trusted counts (``forward_s``): measured; for a MoE, else priced by the experts
        it runs (``ExpertsCostModel.cost``); for a dense model, else interpolated linearly
        between the nearest measured counts, else extrapolated from the two largest (with one
        measured count, at PRIOR_ROW_COST of it a row above it, and its cost below it); 0 before any."""
        table = self.forward_s
        if rows in table:
            return table[rows]
        if not table:
            return 0.0
        if self.experts is not None:
            return self.experts.cost(rows, table)
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
            return table[top] * (1 + self.PRIOR_ROW_COST * (rows - top))
        prev = counts[-2]
        slope = max(0.0, (table[top] - table[prev]) / (top - prev))
        return table[top] + slope * (rows - top)

    def plan(
        self, base_rows: int, requests: list[tuple[list[float], int]], made: bool = False, max_rows: int | None = None
    ) -> list[int]:
        """requests: (acceptance estimates c_1.., cap) per drafting request; returns each one's k.
        ``made``: the drafts are already made (their drafting time is spent whatever k);
        ``max_rows``: at most this many draft rows in all (the pass's row budget)."""
        draft_s = 0.0 if made else self.draft_s_per_token
        ks = [0] * len(requests)
        if not self.plain_cost_known(base_rows):  # not yet measured enough: measure the plain pass first
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
