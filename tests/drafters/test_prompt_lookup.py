import doctest

import pytest
import torch

import fastdecode.drafters.prompt_lookup as prompt_lookup
from fastdecode.drafters.base import Draft, build_drafter
from fastdecode.drafters.prompt_lookup import PromptLookupDrafter, find_candidate_pred_tokens
from fastdecode.errors import ConfigError


def test_docstring_examples_hold():
    assert doctest.testmod(prompt_lookup).failed == 0


def test_bigram_match_copies_continuation():
    # last bigram (3, 4) occurs at 2 -> continuation 5, 6, 3
    assert find_candidate_pred_tokens([1, 2, 3, 4, 5, 6, 3, 4], k=3) == [5, 6, 3]


def test_earliest_match_wins():
    # (1, 2) occurs at 0 (then 7 8) and at 4 (then 9): the earliest is taken
    assert find_candidate_pred_tokens([1, 2, 7, 8, 1, 2, 9, 1, 2], k=2) == [7, 8]


def test_longer_ngram_preferred_over_earlier_shorter_one():
    # unigram 2 first occurs at 0 (then 5), but bigram (3, 2) occurs at 2 (then 6)
    assert find_candidate_pred_tokens([2, 5, 3, 2, 6, 3, 2], k=1) == [6]


def test_falls_back_to_shorter_ngram():
    # (8, 4) never occurred before; 4 occurs at 1 -> 5 6 8
    assert find_candidate_pred_tokens([1, 4, 5, 6, 8, 4], k=3) == [5, 6, 8]
    # with min_ngram_size=2 there is no fallback
    assert find_candidate_pred_tokens([1, 4, 5, 6, 8, 4], k=3, min_ngram_size=2) == []


def test_larger_max_ngram_size():
    # trigram (1, 2, 3) first at 3 -> 7; bigram (2, 3) first at 0 -> 9
    context = [2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert find_candidate_pred_tokens(context, k=1, max_ngram_size=3) == [7]
    assert find_candidate_pred_tokens(context, k=1, max_ngram_size=2) == [9]


def test_no_match_gives_empty():
    assert find_candidate_pred_tokens([1, 2, 3, 4], k=5) == []
    assert find_candidate_pred_tokens([], k=5) == []
    assert find_candidate_pred_tokens([7], k=5) == []


def test_k_truncates_and_continuation_stops_at_context_end():
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    assert find_candidate_pred_tokens(context, k=2) == [3, 4]
    # (1, 2) at 0: everything up to the end of the context, no more
    assert find_candidate_pred_tokens(context, k=100) == [3, 4, 5, 6, 1, 2]
    assert find_candidate_pred_tokens(context, k=0) == []


def test_overlapping_match_in_a_run():
    # (5, 5) at 0 overlaps the trailing one; only one token follows it
    assert find_candidate_pred_tokens([5, 5, 5], k=4) == [5]


def test_match_without_continuation_is_skipped():
    # unigram 4: its only other occurrence is the final token itself -> skipped;
    # the bigram (3, 4) likewise; nothing matches
    assert find_candidate_pred_tokens([1, 2, 3, 4], k=3) == []
    # (9, 4) unseen; 4 at 1 -> 9, 4
    assert find_candidate_pred_tokens([0, 4, 9, 4], k=3) == [9, 4]


def test_accepts_tensor_context():
    assert find_candidate_pred_tokens(torch.tensor([1, 2, 3, 1]), k=2) == [2, 3]


def test_drafter_propose():
    d = PromptLookupDrafter(k=4)
    d.begin([1, 2, 3, 1, 2])
    draft = d.propose([1, 2, 3, 1, 2], 2)
    assert isinstance(draft, Draft)
    assert draft.tokens == [3, 1]
    assert draft.q is None
    assert d.propose([1, 2, 3], 2).tokens == []


@pytest.mark.parametrize(
    "options",
    [{"k": 0}, {"max_ngram_size": 0}, {"min_ngram_size": 0}, {"max_ngram_size": 1, "min_ngram_size": 2}],
)
def test_bad_options_raise_config_error(options):
    with pytest.raises(ConfigError):
        PromptLookupDrafter(**options)


def test_registry_builds_prompt_lookup_by_name():
    d = build_drafter("prompt-lookup", k=3, max_ngram_size=3)
    assert isinstance(d, PromptLookupDrafter)
    assert (d.k, d.max_ngram_size) == (3, 3)
