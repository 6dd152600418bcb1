"""The batch draft policy on its own: measured pass costs, interpolation, and the plan it
makes from them (no model: costs and acceptance estimates are given)."""

from __future__ import annotations

from fastdecode.engine import BatchDraftPolicy


def _measured(policy: BatchDraftPolicy, rows: int, seconds: float, times: int = BatchDraftPolicy.MIN_SAMPLES) -> None:
    """Record one pass time ``times`` times (a cost is trusted from MIN_SAMPLES timings on)."""
    for _ in range(times):
        policy.record_forward(rows, seconds)


def test_plain_pass_is_measured_before_any_draft_is_planned():
    policy = BatchDraftPolicy()
    assert policy.plan(8, [([0.9] * 4, 4)] * 8) == [0] * 8
    _measured(policy, 8, 1.0, times=BatchDraftPolicy.MIN_SAMPLES - 1)
    assert policy.plan(8, [([0.9] * 4, 4)] * 8) == [0] * 8  # one timing or two plan nothing
    _measured(policy, 4, 0.5)
    _measured(policy, 40, 1.1)
    assert sum(policy.plan(8, [([0.9] * 4, 4)] * 8)) > 0  # 8 rows lies between two measured counts


def test_cost_interpolates_and_extrapolates_from_measurements():
    policy = BatchDraftPolicy()
    assert policy.cost(5) == 0.0
    _measured(policy, 8, 1.0, times=BatchDraftPolicy.MIN_SAMPLES - 1)
    assert policy.cost(4) == 0.0 and not policy.known(8)  # no cost from fewer than MIN_SAMPLES timings
    policy.record_forward(8, 1.0)
    assert policy.known(8)
    # one count: its cost below it, a prior cost a row above it (the first drafts of a process are short)
    assert policy.cost(4) == 1.0 and policy.cost(10) == 1.0 + 2 * BatchDraftPolicy.PRIOR_ROW_COST
    _measured(policy, 16, 2.0)
    assert policy.cost(12) == 1.5
    assert policy.cost(24) == 3.0  # the slope of the two largest
    policy.record_forward(16, 4.0)  # a median, not the last value
    assert policy.cost(16) == 2.0


def test_drafts_are_planned_only_while_they_pay():
    policy = BatchDraftPolicy()
    _measured(policy, 8, 1.0)
    _measured(policy, 40, 1.1)  # cheap rows: drafting with good acceptance pays
    good = policy.plan(8, [([0.8] * 4, 4)] * 8)
    assert sum(good) == 32
    policy = BatchDraftPolicy()
    _measured(policy, 8, 1.0)
    _measured(policy, 16, 2.0)  # each extra row costs as much as a whole token's share
    assert policy.plan(8, [([0.3] * 4, 4)] * 8) == [0] * 8
    # the most promising request gets rows first
    policy = BatchDraftPolicy()
    _measured(policy, 2, 1.0)
    _measured(policy, 4, 1.2)
    _measured(policy, 10, 3.0)
    ks = policy.plan(2, [([0.9, 0.9, 0.9], 3), ([0.1, 0.1, 0.1], 3)])
    assert ks[0] > 0 and ks[1] == 0


def test_the_plan_weighs_every_length_not_only_up_to_the_first_dear_row():
    # Measured pass times are noisy: here 3 rows happened to cost more than 4. A drafter accepted
    # 95% of the time at 4 ms a token: 5 tokens pay (7.1 ms a token against 30 for plain decoding)
    # although the second token's row alone looks dear.
    policy = BatchDraftPolicy()
    for rows, ms in {1: 30, 2: 31, 3: 45, 4: 33, 5: 34, 6: 35}.items():
        _measured(policy, rows, ms / 1000)
    policy.record_draft(1, 0.004)
    assert policy.plan(1, [([0.95] * 5, 5)]) == [5]
    assert policy.plan(1, [([0.05] * 5, 5)]) == [0]  # and none when no length pays


def _fp32_like() -> BatchDraftPolicy:
    """A policy measured five times at 1..8 rows: 30 ms for one row, 1 ms for each extra row."""
    policy = BatchDraftPolicy()
    for _ in range(5):
        for rows in range(1, 9):
            policy.record_forward(rows, 0.030 + 0.001 * (rows - 1))
    return policy


GOOD_DRAFTS = [([0.9] * 7, 7)]  # one request alone, accepted 90% of the time, K <= 7


def test_one_outlying_timing_does_not_change_the_plan():
    policy = _fp32_like()
    assert policy.plan(1, GOOD_DRAFTS) == [7]
    policy.record_forward(8, 0.500)  # one pass 15x slower than usual (a page fault, a busy moment)
    assert policy.plan(1, GOOD_DRAFTS) == [7]
    policy.record_forward(1, 0.001)  # and one absurdly fast plain pass
    assert policy.plan(1, GOOD_DRAFTS) == [7]
    assert policy.shifts == 0
    policy.record_draft(1, 1.0)  # one drafting time of a second a token, among fast ones
    for _ in range(4):
        policy.record_draft(7, 0.0007)
    assert policy.plan(1, GOOD_DRAFTS) == [7]


def test_a_sustained_shift_changes_the_plan_and_rescales_the_other_counts():
    # 8-row passes become 3x dearer and stay so, the others as before: the plan stops drafting 7 tokens
    policy = _fp32_like()
    for _ in range(BatchDraftPolicy.SHIFT_RUN):
        for rows in range(1, 8):
            policy.record_forward(rows, 0.030 + 0.001 * (rows - 1))
        policy.record_forward(8, 0.111)
    assert policy.shifts == 1 and policy.cost(8) == 0.111 and policy.cost(7) == 0.036
    assert policy.plan(1, GOOD_DRAFTS)[0] < 7
    # the machine gets busy: plain passes take twice as long, and the counts not measured since
    # (an estimate until they are) follow by the same ratio
    policy = _fp32_like()
    before = policy.cost(5)
    for _ in range(BatchDraftPolicy.SHIFT_RUN):
        policy.record_forward(1, 0.060)
    assert policy.shifts == 1 and abs(policy.cost(5) - 2 * before) < 1e-9
    assert policy.known(5)


def test_the_first_request_of_a_process_drafts_short_until_wider_passes_are_measured():
    """Only the 1-row pass measured (a process's first request): each row above it is priced at
    PRIOR_ROW_COST of it (the dearest row measured, GGUF's), so at acceptance 1/2 the plan drafts
    one or two tokens, not the cap; once wider passes measure cheap, it drafts more."""
    policy = BatchDraftPolicy()
    _measured(policy, 1, 0.010)
    first = policy.plan(1, [([0.5] * 7, 7)])[0]
    assert 1 <= first <= 2
    _measured(policy, 8, 0.011)  # 8 rows measured at 1.1x one row: drafting is nearly free here
    assert policy.plan(1, [([0.5] * 7, 7)])[0] > first
