"""AcceptanceStats arithmetic and the shape of GenerationResult.to_dict."""

from __future__ import annotations

import json

import pytest

from fastdecode.decoding.metrics import AcceptanceStats, GenerationResult


@pytest.fixture
def stats():
    s = AcceptanceStats(draft_k=4)
    s.record(4, 4, 5)  # all accepted + bonus
    s.record(4, 1, 2)  # rejected at position 1
    s.record(2, 0, 1)  # rejected at position 0
    s.record(0, 0, 1)  # empty draft
    return s


def test_totals(stats):
    assert stats.steps == 4
    assert stats.drafted_tokens == 10
    assert stats.accepted_tokens == 5
    assert stats.step_tokens == 9


def test_alpha_and_tau(stats):
    assert stats.alpha == pytest.approx(0.5)
    assert stats.tau == pytest.approx(9 / 4)  # counts the bonus token


def test_per_position_acceptance(stats):
    # position i: steps that drafted >= i + 1 tokens, and how many kept token i
    # 0: 3 steps, 2 kept; 1: 3 steps, 1 kept; 2: 2 steps, 1 kept; 3: 2 steps, 1 kept
    assert stats.per_position_acceptance == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])


def test_alpha_k_bound(stats):
    assert stats.alpha_k_bound == pytest.approx(0.5 * 4 + 1)


def test_empty_stats():
    s = AcceptanceStats(draft_k=7)
    assert (s.alpha, s.tau, s.per_position_acceptance, s.alpha_k_bound) == (0.0, 0.0, [], 1.0)


def test_plain_decoding_steps_have_tau_one():
    s = AcceptanceStats(draft_k=3)
    for _ in range(5):
        s.record(0, 0, 1)
    assert s.tau == 1.0 and s.alpha == 0.0 and s.steps == 5


def test_stats_to_dict(stats):
    d = stats.to_dict()
    assert d == {
        "steps": 4,
        "drafted_tokens": 10,
        "accepted_tokens": 5,
        "acceptance_rate": pytest.approx(0.5),
        "mean_tokens_per_step": pytest.approx(2.25),
        "nodes_per_step": pytest.approx(10 / 4),
        "tau_counts_bonus_token": True,
        "per_position_acceptance": pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2]),
        "draft_k": 4,
        "alpha_k_bound": pytest.approx(3.0),
        "alternative_tokens": 0,
        "alternative_wins": 0,
        "alternative_extra_tokens": 0,
        "by_source": {},
    }
    assert not any(key.startswith("_") for key in d)


def _result(acceptance):
    return GenerationResult(
        token_ids=[5, 6, 7],
        text="abc",
        num_prompt_tokens=4,
        num_new_tokens=3,
        ttft_s=0.01,
        decode_tokens_per_s=100.0,
        wall_s=0.05,
        finish_reason="length",
        drafter="ngram" if acceptance else "none",
        acceptance=acceptance,
    )


REQUIRED_KEYS = {
    "text",
    "token_ids",
    "num_prompt_tokens",
    "num_new_tokens",
    "ttft_s",
    "decode_tokens_per_s",
    "wall_s",
    "drafter",
    "acceptance",
    "finish_reason",
}


def test_result_to_dict_with_acceptance(stats):
    d = _result(stats).to_dict()
    assert set(d) >= REQUIRED_KEYS
    assert d["token_ids"] == [5, 6, 7] and d["text"] == "abc"
    assert d["num_prompt_tokens"] == 4 and d["num_new_tokens"] == 3
    assert d["ttft_s"] == 0.01 and d["decode_tokens_per_s"] == 100.0 and d["wall_s"] == 0.05
    assert d["drafter"] == "ngram"
    assert d["acceptance"] == stats.to_dict()
    json.dumps(d)  # plain data, ready for the CLI / server


def test_result_to_dict_without_acceptance():
    d = _result(None).to_dict()
    assert set(d) >= REQUIRED_KEYS
    assert d["acceptance"] is None and d["drafter"] == "none"
    json.dumps(d)


def test_alternative_paths_are_counted_apart_from_the_main_chain():
    s = AcceptanceStats(draft_k=4)
    s.record(4, 3, 4, num_alternative_tokens=6, main_accepted=1)  # an alternative path kept: 3 accepted vs 1
    s.record(4, 2, 3, num_alternative_tokens=3)  # the main chain kept
    assert (s.drafted_tokens, s.accepted_tokens, s.alternative_tokens) == (17, 5, 9)
    assert (s.alternative_wins, s.alternative_extra_tokens) == (1, 2)
    assert s.per_position_acceptance == [1.0, 0.5, 0.0, 0.0]  # the main chain's: 1 then 2 accepted


def test_acceptance_by_source_counts_reached_tokens():
    s = AcceptanceStats(draft_k=4)
    s.record(4, 2, 3)
    s.record_sources(["5-gram", "5-gram", "2-gram", "2-gram"], 2)  # 2 accepted, the 2-gram rejected, the last unreached
    s.record(2, 2, 3)
    s.record_sources(["2-gram", "table"], 2)
    assert s.by_source == {
        "2-gram": {"drafted": 3, "reached": 2, "accepted": 1},
        "5-gram": {"drafted": 2, "reached": 2, "accepted": 2},
        "table": {"drafted": 1, "reached": 1, "accepted": 1},
    }
    assert s.source_acceptance("5-gram") == pytest.approx(3 / 4)
    assert s.source_acceptance("2-gram") == pytest.approx(2 / 4)
    assert s.source_acceptance("unseen") == 0.5
    assert s.to_dict()["by_source"] == s.by_source


def test_conditional_acceptance_counts_only_the_drafts_that_reached_a_position():
    stats = AcceptanceStats(draft_k=3)
    stats.record(3, 1, 2)  # positions 0 and 1 reached, 0 accepted
    stats.record(3, 3, 4)  # all reached and accepted
    stats.record(1, 0, 1)  # position 0 reached, rejected
    assert stats.per_position_acceptance == [2 / 3, 1 / 2, 1 / 2]  # unconditional: of the drafts that had it
    p = (4 + 1) / (6 + 2)  # the request's pooled rate, the prior of every position
    assert stats.conditional_acceptance(4) == pytest.approx([(2 + 2 * p) / 5, (1 + 2 * p) / 4, (1 + 2 * p) / 3, p])
    # chained, they give the chance of a prefix accepted whole: c_0 * c_1 against 1 in 3 drafts so far
    c = stats.conditional_acceptance(2)
    assert c[0] == pytest.approx(0.65) and c[0] * c[1] == pytest.approx(0.65 * (1 + 2 * p) / 4)
    assert AcceptanceStats(draft_k=2).conditional_acceptance(2) == [0.5, 0.5]  # nothing seen yet


def test_doctests():
    import doctest

    from fastdecode.decoding import metrics

    assert doctest.testmod(metrics).failed == 0
