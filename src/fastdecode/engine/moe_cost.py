"""What a mixture of experts' pass costs: a dense part by rows, plus a cost per expert it runs.

A verification pass of r rows runs the union of the experts its rows route to (``ExpertsMLP``: each
active expert once over its rows), so where a dense model's pass grows by a fraction of a step per
row, a MoE's grows by whole experts read until the union saturates (MoE-Spec, McDanel et al. 2026;
llama.cpp's ngram-mod notes that MoEs want long drafts only where they are accepted). The model:

    T(r) = T(m) + b * (r - m) + c * (X(r) - X(m))

for a row count r not measured, anchored on the nearest measured count m (``BatchDraftPolicy``'s
medians; a measured count keeps its median). X(r): the distinct experts a pass of r rows runs,
summed over the MoE layers - the mean of the counts the executor reported for passes of r rows
(``Executor.take_experts_run``), else uniform routing's L * E * (1 - (1 - k/E)^r) scaled by the
ratio measured at the nearest counted row count (routing is rarely uniform: a sequence's tokens
share experts). c: seconds per expert, b: the dense part's seconds per row, fitted by least squares
to the measured medians when three or more counts are measured and the fit is non-negative; else c
is the expert's share of a one-row step's bytes times that step's time (a decode step streams its
weights) and b the dense prior (``BatchDraftPolicy.PRIOR_ROW_COST`` of that step a row), or the
slope left once the experts are taken out when two counts are measured.

Lossless by construction: the model chooses draft lengths only; no expert is dropped or substituted.
"""

from __future__ import annotations

from collections import deque

from fastdecode.backends.base import ExpertsProfile


class ExpertsCostModel:
    """Pass cost of a MoE target from the experts it runs (see the module docstring)."""

    SAMPLES = 32  # distinct-expert counts kept per row count

    def __init__(self, profile: ExpertsProfile, prior_row_cost: float) -> None:
        self.profile = profile
        self.prior_row_cost = prior_row_cost
        self._counts: dict[int, deque[int]] = {}  # rows -> distinct experts of its latest passes
        # (table, counts recorded, (b, c)): the last fit, kept while neither changed (a plan asks cost() per row)
        self._fit: tuple[dict[int, float], int, tuple[float, float]] | None = None
        self._recorded = 0

    def record(self, rows: int, experts: int) -> None:
        self._counts.setdefault(rows, deque(maxlen=self.SAMPLES)).append(experts)
        self._recorded += 1

    def uniform_experts(self, rows: float) -> float:
        """X(r) under uniform routing: each layer's expected union of r draws of top_k of n_experts."""
        p = self.profile
        return p.n_layers * p.n_experts * (1 - (1 - p.top_k / p.n_experts) ** rows)

    def expected_experts(self, rows: int) -> float:
        """X(rows): measured mean where counted, else uniform scaled by the nearest counted ratio."""
        if rows <= 0:
            return 0.0
        counts = self._counts.get(rows)
        if counts:
            return sum(counts) / len(counts)
        uniform = self.uniform_experts(rows)
        if not self._counts:
            return uniform
        near = min(self._counts, key=lambda m: (abs(m - rows), -m))
        ratio = self.expected_experts(near) / self.uniform_experts(near)
        p = self.profile
        return min(uniform * ratio, p.n_layers * min(p.n_experts, p.top_k * rows))

    def slopes(self, table: dict[int, float]) -> tuple[float, float]:
        """(b, c): the dense part's seconds per row and the seconds per expert run, from the measured table."""
        counts = sorted(table)
        p, first = self.profile, table[counts[0]]  # the smallest pass measured (usually one row) sets the priors
        # its bytes: a one-row step's, plus the experts beyond top_k a layer it ran; one expert's share of them
        extra_experts = max(0.0, self.expected_experts(counts[0]) - p.n_layers * p.top_k)
        c_prior = first * p.expert_share / (1 + p.expert_share * extra_experts)
        if len(counts) >= 3:
            fit = _least_squares(counts, [self.expected_experts(m) for m in counts], [table[m] for m in counts])
            if fit is not None and fit[0] >= 0 and fit[1] >= 0:
                return fit
        if len(counts) >= 2:
            lo, hi = counts[0], counts[-1]
            rest = table[hi] - table[lo] - c_prior * (self.expected_experts(hi) - self.expected_experts(lo))
            return max(0.0, rest / (hi - lo)), c_prior
        return self.prior_row_cost * first, c_prior

    def cost(self, rows: int, table: dict[int, float]) -> float:
        """T(rows) for a count not in ``table`` (row count -> measured median seconds, not empty)."""
        below = [m for m in table if m < rows]
        anchor = max(below) if below else min(table)
        if self._fit is None or self._fit[0] is not table or self._fit[1] != self._recorded:
            self._fit = (table, self._recorded, self.slopes(table))
        b, c = self._fit[2]
        extra = b * (rows - anchor) + c * (self.expected_experts(rows) - self.expected_experts(anchor))
        return max(0.0, table[anchor] + extra)


def _least_squares(rows: list[int], experts: list[float], seconds: list[float]) -> tuple[float, float] | None:
    """(b, c) of seconds ~ a + b * rows + c * experts (None: the columns are collinear)."""
    n = len(rows)
    mr, mx, ms = sum(rows) / n, sum(experts) / n, sum(seconds) / n
    r = [v - mr for v in rows]
    x = [v - mx for v in experts]
    s = [v - ms for v in seconds]
    srr, sxx, srx = sum(a * a for a in r), sum(a * a for a in x), sum(a * b for a, b in zip(r, x))
    srs, sxs = sum(a * b for a, b in zip(r, s)), sum(a * b for a, b in zip(x, s))
    det = srr * sxx - srx * srx
    if det <= 1e-12 * max(1.0, srr * sxx):
        return None
    return (sxx * srs - srx * sxs) / det, (srr * sxs - srx * srs) / det
