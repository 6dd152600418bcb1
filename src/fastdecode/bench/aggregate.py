"""Aggregation of per-sample benchmark rows: pure functions, no I/O, no torch.

Conventions, stated once:

* **speed-up** (the ANPD paper's ratio) = the baseline's total wall time / the
  method's total wall time, summed over the samples both ran, under identical
  conditions (same run, model, dtype, prompts, generation options). Computed
  per category and overall. The baseline is plain decoding by fastdecode's own
  loop (drafter ``none``) in the same run.
* **tokens/s** is the engine's ``decode_tokens_per_s`` (tokens after the first /
  time after the first); mean and median are over samples.
* **alpha** = accepted draft tokens / drafted tokens and **tau** = tokens
  appended by steps / steps (bonus token counted), both pooled over all samples
  (token-weighted, not a mean of per-sample ratios); **alpha_k_bound** = alpha * K + 1.
* **identical** = how many samples' tokens equal the baseline's, of those compared
  (greedy decoding only: under sampling the distributions match, not the tokens).

A row is a mapping with at least ``sample_id``, ``category``, ``wall_s``,
``decode_tokens_per_s``, ``num_new_tokens``, ``identical_to_baseline`` (bool or
None) and ``acceptance`` (None or a mapping with ``steps``, ``drafted_tokens``,
``accepted_tokens``, ``step_tokens``, ``draft_k``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

OVERALL = "overall"
Row = Mapping[str, Any]


def speedup_ratio(baseline_wall_s: Mapping[str, float], method_wall_s: Mapping[str, float]) -> float | None:
    """sum(baseline) / sum(method) over the sample ids both have; None when they share none.

    >>> speedup_ratio({"a": 2.0, "b": 4.0}, {"a": 1.0, "b": 2.0, "c": 9.0})
    2.0
    """
    common = baseline_wall_s.keys() & method_wall_s.keys()
    method_total = sum(method_wall_s[k] for k in common)
    if not common or method_total <= 0:
        return None
    return sum(baseline_wall_s[k] for k in common) / method_total


def speedups_by_category(baseline_rows: Iterable[Row], method_rows: Iterable[Row]) -> dict[str, float | None]:
    """Speed-up per category (in first-seen order) and ``"overall"`` over every shared sample."""
    base = {r["sample_id"]: r for r in baseline_rows}
    method = list(method_rows)
    out: dict[str, float | None] = {}
    for category in dict.fromkeys(r["category"] for r in method):
        m = {r["sample_id"]: r["wall_s"] for r in method if r["category"] == category}
        out[category] = speedup_ratio({k: base[k]["wall_s"] for k in m if k in base}, m)
    out[OVERALL] = speedup_ratio(
        {k: r["wall_s"] for k, r in base.items()}, {r["sample_id"]: r["wall_s"] for r in method}
    )
    return out


@dataclass(frozen=True)
class PromptSpeedup:
    sample_id: str
    category: str
    speedup: float  # the baseline's wall time / the method's, this prompt alone


def worst_prompt(baseline_rows: Iterable[Row], method_rows: Iterable[Row]) -> PromptSpeedup | None:
    """The prompt the method sped up least (or slowed most); None when none is shared.

    >>> base = [{"sample_id": "a", "category": "qa", "wall_s": 2.0}, {"sample_id": "b", "category": "code", "wall_s": 1.0}]
    >>> worst_prompt(base, [{"sample_id": "a", "category": "qa", "wall_s": 1.0}, {"sample_id": "b", "category": "code", "wall_s": 1.25}])
    PromptSpeedup(sample_id='b', category='code', speedup=0.8)
    """
    base = {r["sample_id"]: r["wall_s"] for r in baseline_rows}
    shared = [
        PromptSpeedup(r["sample_id"], r["category"], base[r["sample_id"]] / r["wall_s"])
        for r in method_rows
        if r["sample_id"] in base and r["wall_s"] > 0
    ]
    return min(shared, key=lambda p: p.speedup, default=None)


@dataclass(frozen=True)
class PooledAcceptance:
    steps: int
    drafted_tokens: int
    accepted_tokens: int
    alpha: float  # accepted / drafted
    tau: float  # step tokens / steps, bonus token counted
    alpha_k_bound: float  # alpha * K + 1
    # drafters that name their tokens' sources: source -> (drafted, reached, accepted), pooled
    by_source: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def nodes_per_step(self) -> float:
        """Draft tokens verified per step: the chain, or the token tree's nodes."""
        return self.drafted_tokens / self.steps if self.steps else 0.0


def pooled_acceptance(acceptances: Iterable[Mapping[str, Any] | None], draft_k: int) -> PooledAcceptance | None:
    """Token-weighted alpha and tau over many requests; None when none carried acceptance stats.

    >>> a = pooled_acceptance([{"steps": 2, "drafted_tokens": 4, "accepted_tokens": 3, "step_tokens": 5},
    ...                        {"steps": 2, "drafted_tokens": 4, "accepted_tokens": 1, "step_tokens": 3}], draft_k=2)
    >>> (a.alpha, a.tau, a.alpha_k_bound)
    (0.5, 2.0, 2.0)
    """
    items = [a for a in acceptances if a is not None]
    if not items:
        return None
    steps = sum(a["steps"] for a in items)
    drafted = sum(a["drafted_tokens"] for a in items)
    accepted = sum(a["accepted_tokens"] for a in items)
    step_tokens = sum(a["step_tokens"] for a in items)
    alpha = accepted / drafted if drafted else 0.0
    by_source: dict[str, tuple[int, int, int]] = {}
    for a in items:
        for source, c in (a.get("by_source") or {}).items():
            d, r, acc = by_source.get(source, (0, 0, 0))
            by_source[source] = (d + c["drafted"], r + c["reached"], acc + c["accepted"])
    return PooledAcceptance(
        steps,
        drafted,
        accepted,
        alpha,
        step_tokens / steps if steps else 0.0,
        alpha * draft_k + 1,
        dict(sorted(by_source.items())),
    )


@dataclass(frozen=True)
class StepCost:
    """What a decode step cost, pooled over requests: the target pass that verified it
    and the drafting before it, in mean milliseconds a step."""

    passes: int
    pass_ms: float
    draft_ms: float


def step_cost(rows: Iterable[Row]) -> StepCost | None:
    """Pass-weighted step cost of ``rows``; None when none recorded a decode pass (a peer's rows).

    >>> c = step_cost([{"decode_passes": 3, "decode_pass_s": 0.03, "draft_s": 0.0},
    ...                {"decode_passes": 1, "decode_pass_s": 0.02, "draft_s": 0.004}])
    >>> (c.passes, round(c.pass_ms, 3), round(c.draft_ms, 3))
    (4, 12.5, 1.0)
    """
    rows = [r for r in rows if r.get("decode_passes")]
    passes = sum(r["decode_passes"] for r in rows)
    if not passes:
        return None
    return StepCost(
        passes, 1000 * sum(r["decode_pass_s"] for r in rows) / passes, 1000 * sum(r["draft_s"] for r in rows) / passes
    )


def identical_count(rows: Iterable[Row]) -> tuple[int, int]:
    """(samples identical to the baseline, samples compared)."""
    flags = [r["identical_to_baseline"] for r in rows if r.get("identical_to_baseline") is not None]
    return sum(1 for f in flags if f), len(flags)


@dataclass(frozen=True)
class ConfigSummary:
    samples: int
    new_tokens: int
    wall_s: float  # total over samples
    mean_tokens_per_s: float
    median_tokens_per_s: float
    speedup: float | None  # overall, vs the baseline
    speedup_by_category: dict[str, float | None]
    acceptance: PooledAcceptance | None
    identical: int
    compared: int
    acceptance_by_category: dict[str, PooledAcceptance | None] = field(default_factory=dict)
    step_cost: StepCost | None = None
    step_cost_by_category: dict[str, StepCost | None] = field(default_factory=dict)
    worst_prompt: PromptSpeedup | None = None  # the least sped-up prompt (a user judges by theirs, not the mean)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_config(rows: Sequence[Row], baseline_rows: Sequence[Row], draft_k: int | None = None) -> ConfigSummary:
    """Everything the report says about one configuration, from its rows and its baseline's."""
    tps = [r["decode_tokens_per_s"] for r in rows]
    by_cat = speedups_by_category(baseline_rows, rows)
    if draft_k is None:
        draft_k = next((r["acceptance"]["draft_k"] for r in rows if r.get("acceptance")), 0)
    same, compared = identical_count(rows)
    categories = sorted({r["category"] for r in rows})
    return ConfigSummary(
        samples=len(rows),
        new_tokens=sum(r["num_new_tokens"] for r in rows),
        wall_s=sum(r["wall_s"] for r in rows),
        mean_tokens_per_s=statistics.fmean(tps) if tps else 0.0,
        median_tokens_per_s=statistics.median(tps) if tps else 0.0,
        speedup=by_cat.pop(OVERALL, None),
        speedup_by_category=by_cat,
        acceptance=pooled_acceptance((r.get("acceptance") for r in rows), draft_k),
        acceptance_by_category={
            c: pooled_acceptance((r.get("acceptance") for r in rows if r["category"] == c), draft_k) for c in categories
        },
        identical=same,
        compared=compared,
        step_cost=step_cost(rows),
        step_cost_by_category={c: step_cost(r for r in rows if r["category"] == c) for c in categories},
        worst_prompt=worst_prompt(baseline_rows, rows),
    )


def median_repeat(walls: Sequence[float]) -> int:
    """Index of the repeat whose wall time is the (lower) median: the run a row reports.

    >>> median_repeat([3.0, 1.0, 2.0])
    2
    >>> median_repeat([4.0, 1.0, 3.0, 2.0])
    3
    """
    order = sorted(range(len(walls)), key=lambda i: walls[i])
    return order[(len(walls) - 1) // 2]


@dataclass
class Grid:
    """A 2-D sweep laid out for a heatmap: ``values[i][j]`` at (rows[i], cols[j]); None where not run."""

    row_axis: str
    col_axis: str
    rows: list[Any]
    cols: list[Any]
    values: list[list[float | None]] = field(default_factory=list)


def sweep_grid(points: Iterable[tuple[Mapping[str, Any], float | None]]) -> Grid | None:
    """Lay out ``(sweep_point, value)`` pairs whose points have two coordinates; the
    first key is the row axis. None when there are none or they are not 2-D.

    >>> g = sweep_grid([({"N": 2, "K": 1}, 1.5), ({"N": 2, "K": 2}, 1.7), ({"N": 3, "K": 1}, 1.2)])
    >>> g.rows, g.cols, g.values
    ([2, 3], [1, 2], [[1.5, 1.7], [1.2, None]])
    """
    points = list(points)
    if not points or any(len(p) != 2 for p, _ in points):
        return None
    row_axis, col_axis = list(points[0][0])
    rows = sorted({p[row_axis] for p, _ in points})
    cols = sorted({p[col_axis] for p, _ in points})
    cell = {(p[row_axis], p[col_axis]): v for p, v in points}
    return Grid(row_axis, col_axis, rows, cols, [[cell.get((r, c)) for c in cols] for r in rows])
