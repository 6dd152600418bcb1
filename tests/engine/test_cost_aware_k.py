"""The cost-aware draft length at batch 1: the batch policy's plan for one request, from
pass costs and the request's own acceptance counts; then lossless end to end."""

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.decoding.metrics import AcceptanceStats
from fastdecode.engine import BatchDraftPolicy


def _stats(history, k_max, prior_rate=0.5):
    """AcceptanceStats fed (drafted, accepted) steps, and its conditional estimates up to k_max."""
    stats = AcceptanceStats(draft_k=k_max, prior_rate=prior_rate)
    for drafted, accepted in history:
        stats.record(drafted, accepted, accepted + 1)
    return stats.conditional_acceptance(k_max)


def _policy(costs, draft_s_per_token=0.0):
    policy = BatchDraftPolicy()
    policy.forward_s = costs  # as if each had been measured MIN_SAMPLES times
    if draft_s_per_token:
        policy.record_draft(1, draft_s_per_token)
    return policy


def test_expensive_wide_verification_gives_a_short_draft():
    # fp32-like costs: 2 rows nearly free, wider passes expensive
    policy = _policy({1: 0.030, 2: 0.031, 3: 0.045, 5: 0.050, 9: 0.065})
    # first position accepted 60% of the time, later ones never
    cs = _stats([(8, 0)] * 50 + [(8, 1)] * 75, 8)
    # E(1) = 1 + c1 with c1 ~ 0.6: 1.6 / 0.031 beats every wider draft
    assert policy.plan(1, [(cs, 8)]) == [1]


def test_flat_verification_cost_and_good_acceptance_give_the_widest_draft():
    policy = _policy({n: 0.030 + 0.0005 * n for n in range(1, 8)})  # bf16/AMX-like: width almost free
    assert policy.plan(1, [(_stats([(6, 6)] * 100, 6), 6)]) == [6]


def test_no_draft_when_drafts_are_never_accepted():
    policy = _policy({n: 0.03 * (1 + 0.3 * (n - 1)) for n in range(1, 6)})
    assert policy.plan(1, [(_stats([(4, 0)] * 200, 4), 4)]) == [0]


def test_drafting_time_counts_against_long_drafts():
    cs = _stats([(4, 2)] * 100, 4)
    flat = {n: 0.030 for n in range(1, 6)}
    fast_drafter = _policy(flat).plan(1, [(cs, 4)])[0]
    slow_drafter = _policy(flat, draft_s_per_token=0.050).plan(1, [(cs, 4)])[0]  # costs more than a pass per token
    assert slow_drafter < fast_drafter


def test_positions_never_given_take_the_rate_the_others_show():
    # A drafter accepted 95% of the time, so far only ever asked for one token a step (a model
    # drafter, 8 ms a token, before a 30 ms pass): positions 2.. must not be held at a prior of
    # 1/2, under which two tokens would never pay and they would never be measured.
    policy = _policy({n: 0.030 + 0.0010 * (n - 1) for n in range(1, 8)}, draft_s_per_token=0.008)
    cs = _stats([(1, 1)] * 95 + [(1, 0)] * 5, 6)
    assert policy.plan(1, [(cs, 6)])[0] >= 3


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup", "draft-model"])
def test_cost_aware_decoding_is_lossless_and_measures_its_passes(tiny_model, tokenizer, drafter):
    prompt = [1] + [20, 21, 22, 23] * 6
    plain = Engine(tiny_model, tokenizer).generate(prompt, max_new_tokens=48)
    options = {"model": tiny_model} if drafter == "draft-model" else {}
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter(drafter, **options))
    for _ in range(2):  # the second request starts from the first one's timings
        result = engine.generate(prompt, max_new_tokens=48, cost_aware_k=True, draft_k=4)
        assert result.token_ids == plain.token_ids
    # one table of pass times, kept across requests: the plain pass and wider ones were measured
    assert engine.policy.known(1) and any(engine.policy.timings(rows) for rows in range(2, 10))


def test_a_cost_aware_request_that_stops_drafting_tries_again(tiny_model, tokenizer, oracle_drafter):
    # Passes whose every extra row costs a whole token's time: drafting never pays, so the plan
    # drafts nothing - but one step in EXPLORE_EVERY still drafts a token, so that a text turning
    # repetitive would be noticed. (The pass costs are fixed: a tiny model's are noise.)
    prompt = [1] + [20, 21, 22, 23] * 6
    plain = Engine(tiny_model, tokenizer).generate(prompt, max_new_tokens=100)
    asked = []

    class Asked(oracle_drafter):
        def propose(self, context, k):
            asked.append(k)
            return super().propose(context, k)

    engine = Engine(tiny_model, tokenizer, drafter=Asked(prompt + plain.token_ids))
    engine.policy.forward_s = {n: 0.01 * n for n in range(1, 40)}
    engine.policy.record_forward = lambda rows, seconds: None
    result = engine.generate(prompt, max_new_tokens=100, cost_aware_k=True, draft_k=4)
    assert result.token_ids == plain.token_ids
    explore = BatchDraftPolicy.EXPLORE_EVERY
    assert engine.policy.steps >= explore
    assert asked == [1] * (engine.policy.steps // explore)


def test_a_new_request_starts_from_the_drafters_acceptance_in_earlier_ones(tiny_model, tokenizer):
    # the target drafting for itself: every draft token accepted
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("draft-model", model=tiny_model, k=3))
    # fixed costs under which drafting pays (measured, the tiny target drafting for itself would not)
    engine.policy.forward_s = {n: 0.010 + 0.0001 * n for n in range(1, 10)}
    engine.policy.record_forward = engine.policy.record_draft = lambda *timing: None
    prompt = [1] + [20, 21, 22, 23] * 3
    first = engine.add_request(prompt, cost_aware_k=True, max_new_tokens=24)
    assert engine.get_request(first).stats.prior_rate == 0.5  # nothing seen yet
    while engine.has_unfinished():
        engine.step()
    second = engine.get_request(engine.add_request(prompt, cost_aware_k=True, max_new_tokens=24))
    assert second.stats.prior_rate > 0.9
    assert second.stats.conditional_acceptance(3) == [second.stats.prior_rate] * 3  # before its own first draft


def test_a_sampled_cost_aware_draft_with_its_own_q_keeps_k(tiny_model, tokenizer, monkeypatch):
    # Rejection sampling draws from one stream: a draft length that followed measured pass times
    # would make a seeded request's tokens depend on the machine's timing. Cost-aware or not,
    # such a request drafts K a step (less only at the length limit), and reproduces.
    from fastdecode.drafters.model import DraftModelDrafter

    asked = []
    propose = DraftModelDrafter.propose
    monkeypatch.setattr(
        DraftModelDrafter, "propose", lambda self, context, k: asked.append(k) or propose(self, context, k)
    )
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("draft-model", model=tiny_model, k=3))
    prompt = [1] + [20, 21, 22, 23] * 3
    runs = []
    for _ in range(2):
        asked.clear()
        runs.append(engine.generate(prompt, max_new_tokens=40, cost_aware_k=True, draft_k=3, temperature=0.8, seed=5))
        assert len(asked) > 3 and set(asked[:-2]) == {3}, asked
    assert runs[0].token_ids == runs[1].token_ids
