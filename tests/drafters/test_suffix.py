"""The suffix drafter: longest matches in this request and earlier ones, frequency
trie, the probability gate, draft length from match length; lossless through the engine."""

from __future__ import annotations

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.drafters.suffix import SuffixDrafter
from fastdecode.errors import ConfigError


def test_longest_match_wins_over_a_more_frequent_short_one():
    d = SuffixDrafter(k=4, alpha=2.0, min_prob=0.0)
    #            [7 8 9] -> 1 2 3 once; [x 8 9] -> 5 5 5 twice
    d.begin([7, 8, 9, 1, 2, 3, 0, 6, 8, 9, 5, 5, 5, 0, 4, 8, 9, 5, 5, 5, 0, 7, 8, 9])
    assert d.propose([7, 8, 9], 4).tokens == [1, 2, 3, 0]
    assert d.propose([6, 8, 9], 4).tokens == [5, 5, 5, 0]  # matches [6 8 9] once (length 3)


def test_frequency_decides_among_equal_matches_and_gives_alternatives():
    d = SuffixDrafter(k=3, alpha=2.0, min_prob=0.0)
    d.begin([1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 4, 0, 1, 2])
    draft = d.propose_paths([1, 2], 3, 3)
    assert draft.tokens == [4, 0, 1]
    assert draft.alternatives == ([3, 0, 1],)


def test_paths_branch_where_the_matches_continued_differently():
    d = SuffixDrafter(k=3, alpha=2.0, min_prob=0.0)
    d.begin([1, 2, 4, 0, 9, 1, 2, 4, 0, 9, 1, 2, 4, 5, 8, 1, 2])
    draft = d.propose_paths([1, 2], 3, 3)
    assert draft.tokens == [4, 0, 9]
    assert draft.alternatives == ([4, 5, 8],)  # the other continuation after 4, then its own best path
    gated = SuffixDrafter(k=3, alpha=2.0, min_prob=0.4)  # 5 follows 4 in 1 of 3 matches: below the gate
    gated.begin([1, 2, 4, 0, 9, 1, 2, 4, 0, 9, 1, 2, 4, 5, 8, 1, 2])
    assert gated.propose_paths([1, 2], 3, 3).alternatives == ()


def test_probability_gate_and_match_length_cap():
    d = SuffixDrafter(k=8, alpha=1.0, min_prob=0.6)
    d.begin([1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    assert d.propose([1, 2], 8).tokens == []  # 3 and 4 tie at 1/2 < 0.6
    d = SuffixDrafter(k=8, alpha=1.0, min_prob=0.0)
    d.begin([5, 6, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2])
    assert len(d.propose([0, 1, 2], 8).tokens) == 2  # matched 2 tokens -> at most ceil(1.0 * 2) drafted


def test_memory_of_earlier_requests_is_shared_by_forks_and_bounded():
    d = SuffixDrafter(k=4, max_cached_requests=2, min_prob=0.0, alpha=4.0)
    d.begin([1, 2])
    d.observe([40, 41, 42, 43, 44], 0)
    d.finish()
    twin = d.fork()
    twin.begin([9, 40, 41])
    assert twin.propose([9, 40, 41], 3).tokens == [42, 43, 44]
    for other in ([3, 4, 5, 6], [7, 8, 9, 10]):
        twin.begin(other)
        twin.finish()
    assert len(d.history) == 2
    d.begin([9, 40, 41])
    assert d.propose([9, 40, 41], 3).tokens == []  # the first request was forgotten


@pytest.mark.parametrize("draft_tree", [1, 3])
@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_suffix_greedy_and_seeded_sampling_equal_plain(
    tiny_model, tokenizer, draft_tree, max_num_seqs, linear_pass_costs
):
    prompts = [[1] + [30, 31, 32, 33, 34] * 4, [1, 50, 51, 52], [1, 20, 21, 22, 23] * 4, [1, 9, 8, 7, 6, 5] * 3]
    plain_engine = Engine(tiny_model, tokenizer, max_num_seqs=1)
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("suffix"), max_num_seqs=max_num_seqs)
    for options in ({}, dict(temperature=0.9, seed=3)):
        plain = [r.token_ids for r in plain_engine.generate(prompts, max_new_tokens=30, **options)]
        for _ in range(2):  # the second round also drafts from the first round's outputs
            results = engine.generate(prompts, max_new_tokens=30, draft_tree=draft_tree, **options)
            assert [r.token_ids for r in results] == plain
    assert sum(r.acceptance.accepted_tokens for r in results) > 0


@pytest.mark.parametrize(
    "kwargs", [{"k": 0}, {"alpha": 0}, {"min_prob": 1.5}, {"max_match": 1}, {"max_cached_requests": -1}]
)
def test_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        SuffixDrafter(**kwargs)
