"""The cost-aware draft length policy: pure arithmetic, then lossless end to end."""

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.engine import CostAwareK


def test_tries_the_widest_draft_before_anything_is_measured():
    assert CostAwareK(k_max=8).k == 8


def test_expensive_wide_verification_gives_a_short_draft():
    policy = CostAwareK(k_max=8)
    # fp32-like costs: 2 tokens nearly free, wider ones expensive
    for n, seconds in {1: 0.030, 2: 0.031, 3: 0.045, 5: 0.050, 9: 0.065}.items():
        policy.record_forward(n, seconds)
    for _ in range(50):  # first position accepted 60% of the time, later ones 50%
        policy.update(8, 0)
    for _ in range(75):
        policy.update(8, 1)
    # E(1) = 1 + c0 with c0 ~ 0.6: 1.6 / 0.031 beats every wider draft
    assert policy.k == 1


def test_flat_verification_cost_and_good_acceptance_give_the_widest_draft():
    policy = CostAwareK(k_max=6)
    for n in range(1, 8):
        policy.record_forward(n, 0.030 + 0.0005 * n)  # bf16/AMX-like: width is almost free
    for _ in range(100):
        policy.update(6, 6)
    assert policy.k == 6


def test_no_draft_when_drafts_are_never_accepted():
    policy = CostAwareK(k_max=4)
    for n in range(1, 6):
        policy.record_forward(n, 0.03 * (1 + 0.3 * (n - 1)))
    for _ in range(200):
        policy.update(4, 0)
    assert policy.k == 0


def test_drafting_time_counts_against_long_drafts():
    policy = CostAwareK(k_max=4)
    for n in range(1, 6):
        policy.record_forward(n, 0.030)
    for _ in range(100):
        policy.update(4, 2)
    fast_drafter = policy.k
    policy.record_draft(4, 4 * 0.050)  # a model drafter costing more than a verify per token
    for _ in range(20):
        policy.record_draft(4, 4 * 0.050)
    assert policy.k < fast_drafter


def test_positions_never_given_take_the_rate_the_others_show():
    # A drafter accepted 95% of the time, so far only ever asked for one token a step (a model
    # drafter, 8 ms a token, before a 30 ms pass): positions 1.. must not be held at a prior of
    # 1/2, under which two tokens would never pay and they would never be measured.
    policy = CostAwareK(k_max=6)
    for n in range(1, 8):
        policy.record_forward(n, 0.030 + 0.0010 * (n - 1))
    policy.record_draft(1, 0.008)
    for _ in range(95):
        policy.update(1, 1)
    for _ in range(5):
        policy.update(1, 0)
    assert policy.k >= 3


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
def test_cost_aware_decoding_is_lossless(tiny_model, tokenizer, drafter):
    prompt = [1] + [20, 21, 22, 23] * 6
    plain = Engine(tiny_model, tokenizer).generate(prompt, max_new_tokens=48)
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter(drafter))
    for _ in range(2):  # the second request starts from the first one's timings
        result = engine.generate(prompt, max_new_tokens=48, cost_aware_k=True, draft_k=4)
        assert result.token_ids == plain.token_ids
    policy = engine._cost_policy
    assert policy is not None and policy.k_max == 8 and 1 in policy.forward_s  # timings were measured and kept


def test_a_new_request_starts_from_the_drafters_acceptance_in_earlier_ones(tiny_model, tokenizer):
    # the target drafting for itself: every draft token accepted
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("draft-model", model=tiny_model, k=3))
    prompt = [1] + [20, 21, 22, 23] * 3
    first = engine.add_request(prompt, cost_aware_k=True, max_new_tokens=24)
    assert engine.get_request(first).stats.prior_rate == 0.5  # nothing seen yet
    while engine.has_unfinished():
        engine.step()
    second = engine.get_request(engine.add_request(prompt, cost_aware_k=True, max_new_tokens=24))
    assert second.stats.prior_rate > 0.9 and second.cost_counts.prior_rate == second.stats.prior_rate
    assert second.stats.conditional_acceptance(3) == [second.stats.prior_rate] * 3  # before its own first draft
