"""The aggregation math on fixed inputs: speed-up ratios, pooled acceptance, identity counts, sweep grids."""

import doctest

import pytest

from fastdecode.bench import aggregate
from fastdecode.bench.aggregate import (
    identical_count,
    median_repeat,
    pooled_acceptance,
    speedup_ratio,
    speedups_by_category,
    summarize_config,
    sweep_grid,
)


def row(sample_id, category, wall_s, tps=10.0, new=8, identical=None, acceptance=None):
    return {
        "sample_id": sample_id,
        "category": category,
        "wall_s": wall_s,
        "decode_tokens_per_s": tps,
        "num_new_tokens": new,
        "identical_to_baseline": identical,
        "acceptance": acceptance,
    }


def acc(steps, drafted, accepted, step_tokens, k=4):
    return {
        "steps": steps,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "step_tokens": step_tokens,
        "draft_k": k,
    }


BASE = [row("a", "code", 4.0), row("b", "code", 2.0), row("c", "qa", 3.0)]
METHOD = [row("a", "code", 1.0), row("b", "code", 2.0), row("c", "qa", 3.0)]


def test_doctests():
    assert doctest.testmod(aggregate).failed == 0


def test_speedup_is_ratio_of_summed_wall_times_not_mean_of_ratios():
    # per-sample ratios 4.0 and 1.0 (mean 2.5); the paper's ratio sums first: 6 / 3
    assert speedup_ratio({"a": 4.0, "b": 2.0}, {"a": 1.0, "b": 2.0}) == pytest.approx(2.0)


def test_speedup_uses_only_shared_samples_and_none_when_no_overlap():
    assert speedup_ratio({"a": 4.0, "x": 100.0}, {"a": 2.0, "y": 1.0}) == pytest.approx(2.0)
    assert speedup_ratio({"a": 1.0}, {"b": 1.0}) is None
    assert speedup_ratio({"a": 1.0}, {"a": 0.0}) is None


def test_speedups_by_category_and_overall():
    out = speedups_by_category(BASE, METHOD)
    assert list(out) == ["code", "qa", "overall"]
    assert out["code"] == pytest.approx(6.0 / 3.0)
    assert out["qa"] == pytest.approx(1.0)
    assert out["overall"] == pytest.approx(9.0 / 6.0)


def test_pooled_acceptance_is_token_weighted():
    # sample 1: alpha 1.0 over 2 drafted; sample 2: alpha 0.25 over 8 drafted -> pooled 4/10, not mean 0.625
    pooled = pooled_acceptance([acc(1, 2, 2, 3), acc(4, 8, 2, 6), None], draft_k=4)
    assert pooled.alpha == pytest.approx(0.4)
    assert pooled.tau == pytest.approx(9 / 5)
    assert pooled.alpha_k_bound == pytest.approx(0.4 * 4 + 1)
    assert pooled.nodes_per_step == pytest.approx(10 / 5)
    assert (pooled.steps, pooled.drafted_tokens, pooled.accepted_tokens) == (5, 10, 4)
    assert pooled_acceptance([None, None], draft_k=4) is None


def test_pooled_acceptance_with_nothing_drafted():
    pooled = pooled_acceptance([acc(3, 0, 0, 3)], draft_k=7)
    assert (pooled.alpha, pooled.tau, pooled.alpha_k_bound) == (0.0, 1.0, 1.0)


def test_identical_count_ignores_uncompared_rows():
    rows = [row("a", "c", 1, identical=True), row("b", "c", 1, identical=False), row("c", "c", 1, identical=None)]
    assert identical_count(rows) == (1, 2)


def test_summarize_config():
    method = [
        row("a", "code", 1.0, tps=30.0, new=10, identical=True, acceptance=acc(2, 8, 6, 8)),
        row("b", "code", 2.0, tps=10.0, new=6, identical=True, acceptance=acc(3, 6, 0, 3)),
        row("c", "qa", 3.0, tps=20.0, new=4, identical=False, acceptance=acc(1, 4, 4, 5)),
    ]
    s = summarize_config(method, BASE, draft_k=4)
    assert s.samples == 3 and s.new_tokens == 20 and s.wall_s == pytest.approx(6.0)
    assert s.mean_tokens_per_s == pytest.approx(20.0) and s.median_tokens_per_s == pytest.approx(20.0)
    assert s.speedup == pytest.approx(1.5)
    assert s.speedup_by_category == pytest.approx({"code": 2.0, "qa": 1.0})
    assert s.acceptance.alpha == pytest.approx(10 / 18)
    assert s.acceptance.tau == pytest.approx(16 / 6)
    assert s.acceptance.alpha_k_bound == pytest.approx(10 / 18 * 4 + 1)
    assert (s.identical, s.compared) == (2, 3)


def test_summarize_config_takes_k_from_rows_when_not_given():
    s = summarize_config([row("a", "code", 1.0, acceptance=acc(1, 4, 2, 3, k=4))], BASE)
    assert s.acceptance.alpha_k_bound == pytest.approx(0.5 * 4 + 1)


def test_baseline_against_itself_is_one():
    s = summarize_config(BASE, BASE)
    assert s.speedup == pytest.approx(1.0) and s.acceptance is None
    assert all(v == pytest.approx(1.0) for v in s.speedup_by_category.values())


def test_median_repeat_picks_lower_median():
    assert median_repeat([5.0]) == 0
    assert median_repeat([3.0, 1.0, 2.0]) == 2
    assert median_repeat([4.0, 1.0, 3.0, 2.0]) == 3  # sorted 1,2,3,4 -> lower median 2.0 at index 3


def test_sweep_grid_layout_and_gaps():
    grid = sweep_grid([({"N": 3, "K": 2}, 1.1), ({"N": 2, "K": 1}, 1.5), ({"N": 2, "K": 2}, None)])
    assert (grid.row_axis, grid.col_axis) == ("N", "K")
    assert grid.rows == [2, 3] and grid.cols == [1, 2]
    assert grid.values == [[1.5, None], [None, 1.1]]
    assert sweep_grid([]) is None
    assert sweep_grid([({"N": 2}, 1.0)]) is None


def test_acceptance_pools_sources_and_categories():
    a1 = {
        **acc(2, 4, 3, 5),
        "by_source": {
            "5-gram": {"drafted": 3, "reached": 3, "accepted": 3},
            "2-gram": {"drafted": 1, "reached": 1, "accepted": 0},
        },
    }
    a2 = {**acc(2, 2, 0, 2), "by_source": {"2-gram": {"drafted": 2, "reached": 2, "accepted": 0}}}
    pooled = pooled_acceptance([a1, a2, acc(1, 1, 1, 2)], draft_k=4)  # (an older row without sources)
    assert pooled.by_source == {"2-gram": (3, 3, 0), "5-gram": (3, 3, 3)}
    rows = [row("a", "code", 1.0, acceptance=a1), row("b", "qa", 1.0, acceptance=a2)]
    summary = summarize_config(rows, BASE)
    assert summary.acceptance_by_category["code"].tau == pytest.approx(5 / 2)
    assert summary.acceptance_by_category["qa"].by_source == {"2-gram": (2, 2, 0)}
    assert summary.acceptance_by_category["qa"].nodes_per_step == pytest.approx(1.0)


def test_step_cost_is_pass_weighted_per_category_and_none_without_passes():
    def timed(sample_id, category, passes, pass_s, draft_s):
        return {**row(sample_id, category, 1.0), "decode_passes": passes, "decode_pass_s": pass_s, "draft_s": draft_s}

    rows = [timed("a", "code", 10, 0.10, 0.0), timed("b", "code", 30, 0.60, 0.03), timed("c", "qa", 0, 0.0, 0.0)]
    summary = summarize_config(rows, rows)
    assert summary.step_cost.passes == 40
    assert summary.step_cost.pass_ms == pytest.approx(1000 * 0.70 / 40)  # not the mean of 10 ms and 20 ms
    assert summary.step_cost.draft_ms == pytest.approx(1000 * 0.03 / 40)
    assert summary.step_cost_by_category["code"].pass_ms == pytest.approx(17.5)
    assert summary.step_cost_by_category["qa"] is None  # no decode pass (a one-token answer, or a peer's row)
    assert summarize_config(BASE, BASE).step_cost is None  # rows without the fields (older runs, peers)


def test_the_worst_prompt_is_the_one_sped_up_least():
    base = [row("a", "qa", 2.0), row("b", "code", 1.0), row("c", "code", 3.0)]
    method = [row("a", "qa", 1.0), row("b", "code", 1.25), row("c", "code", 1.0)]
    summary = summarize_config(method, base)
    assert summary.worst_prompt.sample_id == "b" and summary.worst_prompt.speedup == pytest.approx(0.8)
    assert summary.speedup == pytest.approx(6.0 / 3.25)  # the overall figure hides it
    assert summarize_config([row("z", "qa", 1.0)], base).worst_prompt is None
