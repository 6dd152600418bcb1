"""The batch draft policy on its own: measured pass costs, interpolation, and the plan it
makes from them (no model: costs and acceptance estimates are given)."""

from __future__ import annotations

from fastdecode.engine import BatchDraftPolicy


def test_plain_pass_is_measured_before_any_draft_is_planned():
    policy = BatchDraftPolicy()
    assert policy.plan(8, [([0.9] * 4, 4)] * 8) == [0] * 8


def test_cost_interpolates_and_extrapolates_from_measurements():
    policy = BatchDraftPolicy()
    assert policy.cost(5) == 0.0
    policy.record_forward(8, 1.0)
    assert policy.cost(4) == 1.0 and policy.cost(20) == 1.0  # one point: optimistic both ways
    policy.record_forward(16, 2.0)
    assert policy.cost(12) == 1.5
    assert policy.cost(24) == 3.0  # the slope of the two largest
    policy.record_forward(16, 4.0)  # an EMA, not the last value
    assert 2.0 < policy.cost(16) < 4.0


def test_drafts_are_planned_only_while_they_pay():
    policy = BatchDraftPolicy()
    policy.record_forward(8, 1.0)
    policy.record_forward(40, 1.1)  # cheap rows: drafting with good acceptance pays
    good = policy.plan(8, [([0.8] * 4, 4)] * 8)
    assert sum(good) == 32
    policy = BatchDraftPolicy()
    policy.record_forward(8, 1.0)
    policy.record_forward(16, 2.0)  # each extra row costs as much as a whole token's share
    assert policy.plan(8, [([0.3] * 4, 4)] * 8) == [0] * 8
    # the most promising request gets rows first
    policy = BatchDraftPolicy()
    policy.record_forward(2, 1.0)
    policy.record_forward(4, 1.2)
    policy.record_forward(10, 3.0)
    ks = policy.plan(2, [([0.9, 0.9, 0.9], 3), ([0.1, 0.1, 0.1], 3)])
    assert ks[0] > 0 and ks[1] == 0


def test_the_plan_weighs_every_length_not_only_up_to_the_first_dear_row():
    # Measured pass times are noisy: here 3 rows happened to cost more than 4. A drafter accepted
    # 95% of the time at 4 ms a token: 5 tokens pay (7.1 ms a token against 30 for plain decoding)
    # although the second token's row alone looks dear.
    policy = BatchDraftPolicy()
    for rows, ms in {1: 30, 2: 31, 3: 45, 4: 33, 5: 34, 6: 35}.items():
        policy.record_forward(rows, ms / 1000)
    policy.record_draft(1, 0.004)
    assert policy.plan(1, [([0.95] * 5, 5)]) == [5]
    assert policy.plan(1, [([0.05] * 5, 5)]) == [0]  # and none when no length pays
