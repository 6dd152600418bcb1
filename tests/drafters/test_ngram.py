import doctest

import pytest

import fastdecode.drafters.ngram as ngram
from fastdecode.drafters.base import Draft, build_drafter
from fastdecode.drafters.ngram import MultiLevelNGram, NGramDrafter, NGramModule
from fastdecode.errors import ConfigError


def test_docstring_examples_hold():
    assert doctest.testmod(ngram).failed == 0


# --- NGramModule -------------------------------------------------------------


def test_module_initialize_counts_every_ngram():
    m = NGramModule(2)
    # bigrams: 1->2, 2->1, 1->2, 2->3  =>  after 1: {2: 2}; after 2: {1: 1, 3: 1}
    m.initialize([1, 2, 1, 2, 3])
    assert m.query([1]) == (2, 2, 1.0)
    assert m.query([5, 2]) == (3, 1, 0.5)  # tie 1 vs 3: 3 seen last
    assert m.query([3]) is None


def test_module_query_needs_n_minus_1_tokens():
    m = NGramModule(3)
    m.initialize([1, 2, 3])
    assert m.query([2]) is None
    assert m.query([1, 2]) == (3, 1, 1.0)


def test_module_update_adds_one_ngram_from_tail():
    m = NGramModule(3)
    m.update([9, 9, 1, 2], 3)  # only the last n-1 = 2 tokens: (1, 2) -> 3
    assert m.query([1, 2]) == (3, 1, 1.0)
    assert m.query([9, 1]) is None
    m.update([2], 3)  # too short to form a trigram: ignored
    assert m.query([9, 2]) is None
    assert len(m.table) == 1


def test_module_tie_goes_to_most_recently_updated():
    m = NGramModule(2)
    m.update([0], 5)
    m.update([0], 6)  # 5:1, 6:1 -> 6 (latest)
    assert m.query([0]) == (6, 1, 0.5)
    m.update([0], 5)  # 5:2, 6:1 -> 5
    assert m.query([0]) == (5, 2, 2 / 3)
    m.update([0], 6)  # 5:2, 6:2 -> 6 (latest reached the best count)
    assert m.query([0]) == (6, 2, 0.5)
    m.update([0], 7)  # 7:1 < 2: best stays 6
    assert m.query([0]) == (6, 2, 0.4)


# --- MultiLevelNGram ------------------------------------------------------------


def test_mln_prefers_longest_context_and_falls_back():
    mln = MultiLevelNGram(3)
    # bigrams: 1->2 2->3 3->9 9->2 2->4 ; trigrams: 12->3 23->9 39->2 92->4
    mln.initialize([1, 2, 3, 9, 2, 4])
    assert mln.query([1, 2]) == (3, 1, 1.0)  # trigram (1,2)->3 beats bigram 2->4
    assert mln.query([9, 2]) == (4, 1, 1.0)
    assert mln.query([7, 2]) == (4, 1, 0.5)  # (7,2) unseen -> bigram: 3 vs 4, 4 latest
    assert mln.query([7, 8]) is None
    assert mln.query([2]) == (4, 1, 0.5)  # too short for n=3: only n=2 tried


def test_mln_gate_on_count_makes_level_fall_through():
    mln = MultiLevelNGram(3, min_count=2)
    # trigram (1,2)->3 once; bigram 2->5 three times, 2->3 once
    mln.initialize([1, 2, 3, 0, 2, 5, 2, 5, 2, 5])
    assert mln.query([1, 2]) == (5, 3, 0.75)  # trigram count 1 < 2 -> bigram level
    assert mln.query([3]) is None  # 3->0 once: gated, nothing shorter


def test_mln_gate_on_prob_makes_level_fall_through():
    mln = MultiLevelNGram(3, min_prob=0.6)
    # trigrams after (1,2): 3, 4 -> best 4 with p=0.5 (rejected)
    mln.initialize([1, 2, 3, 1, 2, 4, 8, 2, 4])
    # bigrams after 2: 3:1, 4:2 -> (4, 2, 2/3) passes 0.6
    assert mln.query([1, 2]) == (4, 2, 2 / 3)
    # after 1 (n=2): 2:2 -> p=1.0; after (3,1) (n=3): 2 -> p=1.0
    assert mln.query([3, 1]) == (2, 1, 1.0)


def test_mln_update_counts_each_new_token_at_every_order():
    mln = MultiLevelNGram(3)
    mln.initialize([1, 2])  # 1->2
    # context [1, 2, 3, 4] with 3, 4 new: adds 2->3, (1,2)->3, 3->4, (2,3)->4
    mln.update([1, 2, 3, 4], 2)
    assert mln.query([2]) == (3, 1, 1.0)
    assert mln.query([1, 2]) == (3, 1, 1.0)
    assert mln.query([3]) == (4, 1, 1.0)
    assert mln.query([2, 3]) == (4, 1, 1.0)
    assert mln.modules[-1].query([1]) == (2, 1, 1.0)  # not counted twice
    assert len(mln.table) == 5  # (1,) (2,) (3,) (1,2) (2,3)


def test_mln_draft_feeds_predictions_back_and_stops_early():
    mln = MultiLevelNGram(3)
    mln.initialize([1, 2, 3, 4])  # 1->2->3->4 chain; 4 -> nothing
    # [0, 1]: (0,1) unseen -> 1->2; (1,2)->3; (2,3)->4; (3,4) and 4 unseen -> stop
    assert mln.draft([0, 1], 10) == [2, 3, 4]
    assert mln.draft([4], 10) == []


def test_mln_draft_never_exceeds_k_and_does_not_learn():
    mln = MultiLevelNGram(2)
    mln.initialize([5, 5])  # 5->5: an endless chain
    assert mln.draft([5], 3) == [5, 5, 5]
    assert mln.draft([5], 0) == []
    assert mln.query([5]) == (5, 1, 1.0)  # drafting left the counts alone


def test_mln_draft_with_context_shorter_than_n_minus_1():
    mln = MultiLevelNGram(3)
    mln.initialize([1, 2, 3, 1, 2, 4, 2, 3, 5])
    # [2]: bigram 2->3 (3:2, 4:1); then (2,3)->5 via trigram (latest of 1, 5)
    assert mln.draft([2], 2) == [3, 5]


def test_lru_bound_evicts_least_recently_updated_context():
    mln = MultiLevelNGram(2, max_contexts=2)
    mln.initialize([1, 2])  # contexts: (1,)
    mln.update([1, 2, 3], 1)  # (2,)
    mln.update([1, 2, 3, 1], 1)  # (3,) -> evicts (1,), the oldest
    assert mln.query([1]) is None
    assert mln.query([2]) == (3, 1, 1.0)
    mln.update([2, 9], 1)  # 2->9 touches (2,): now (3,) is the oldest
    mln.update([7, 8], 1)  # (7,) -> evicts (3,)
    assert mln.query([3]) is None
    assert mln.query([2]) == (9, 1, 0.5)  # 3 and 9 once each, 9 latest
    assert len(mln.table) == 2


def test_lru_bound_is_shared_across_levels():
    mln = MultiLevelNGram(3, max_contexts=3)
    # initialize, longest order first: (1,2) then (1,) (2,)
    mln.initialize([1, 2, 3])
    assert list(mln.table) == [(1, 2), (1,), (2,)]
    # token 4 adds (2,3)->4, evicting (1,2), then 3->4, evicting (1,)
    mln.update([1, 2, 3, 4], 1)
    assert list(mln.table) == [(2,), (2, 3), (3,)]


# --- NGramDrafter ---------------------------------------------------------------


def test_drafter_propose_returns_deterministic_draft():
    d = NGramDrafter(n=3)
    d.begin([1, 2, 3, 4, 1, 2])
    draft = d.propose([1, 2, 3, 4, 1, 2], 3)
    assert isinstance(draft, Draft)
    # (1,2)->3, (2,3)->4, (3,4)->1
    assert draft.tokens == [3, 4, 1]
    assert draft.q is None
    assert len(d.propose([1, 2], 2)) == 2


def test_drafter_observe_updates_with_accepted_and_bonus_token():
    d = NGramDrafter(n=3)
    d.begin([1, 2])  # (1,)->2 only
    # the loop appended accepted 3 and bonus token 7: context [1, 2, 3, 7]
    d.observe([3, 7], num_accepted=1)
    assert d.context == [1, 2, 3, 7]
    # new n-grams: 2->3, (1,2)->3, 3->7, (2,3)->7
    assert d.mln.query([1, 2]) == (3, 1, 1.0)
    assert d.mln.query([2, 3]) == (7, 1, 1.0)
    assert d.mln.query([9, 3]) == (7, 1, 1.0)
    d.observe([8], num_accepted=0)  # (3,7)->8 and 7->8
    assert d.mln.query([3, 7]) == (8, 1, 1.0)
    assert d.propose([1, 2], 5).tokens == [3, 7, 8]


def test_drafter_non_persistent_forgets_across_begin():
    d = NGramDrafter(n=2)
    d.begin([1, 2])
    d.observe([3], 0)
    d.begin([9])
    assert d.context == [9]
    assert d.propose([1], 3).tokens == []
    assert d.propose([2], 3).tokens == []


def test_drafter_persistent_keeps_memory_across_begin():
    d = NGramDrafter(n=2, persistent=True)
    d.begin([1, 2])
    d.observe([3], 0)  # 1->2, 2->3
    d.begin([9, 1])  # adds 9->1; context restarts at the prompt
    assert d.context == [9, 1]
    assert d.propose([9], 4).tokens == [1, 2, 3]


def test_drafter_gates_pass_through():
    d = NGramDrafter(n=2, min_count=2)
    d.begin([1, 2, 1, 2, 1, 3])  # 1->2 twice, 2->1 twice, 1->3 once
    assert d.propose([2], 3).tokens == [1, 2, 1]
    assert NGramDrafter(n=2, min_prob=1.0).propose([1], 3).tokens == []


@pytest.mark.parametrize(
    "options",
    [
        {"n": 1},
        {"n": 0},
        {"n": 2.5},
        {"k": 0},
        {"k": -3},
        {"min_count": -1},
        {"min_prob": -0.1},
        {"min_prob": 1.5},
        {"max_contexts": 0},
    ],
)
def test_bad_options_raise_config_error(options):
    with pytest.raises(ConfigError):
        NGramDrafter(**options)


def test_module_and_mln_reject_bad_order():
    with pytest.raises(ConfigError):
        NGramModule(1)
    with pytest.raises(ConfigError):
        MultiLevelNGram(1)


def test_registry_builds_ngram_by_name():
    d = build_drafter("ngram", n=3, k=4, persistent=True)
    assert isinstance(d, NGramDrafter)
    assert (d.n, d.k, d.persistent) == (3, 4, True)
    assert d.name == "ngram"
