"""The batch draft policy: how many draft rows a pass should carry, from measured costs.

A pure cost model (no engine state): a table of measured pass times per row count, the
drafting time per token, and the learned yield of alternative paths. ``DraftPlanner``
(``fastdecode.engine.planning``) asks it each step.
"""

from __future__ import annotations


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
    ``DraftPlanner.plan``).

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

    def plan(
        self, base_rows: int, requests: list[tuple[list[float], int]], made: bool = False, max_rows: int | None = None
    ) -> list[int]:
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
