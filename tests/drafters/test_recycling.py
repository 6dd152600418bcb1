"""Token Recycling (``recycling``): the adjacency table fed from the target's own
verification logits, the n-gram back-off, and lossless decoding through the engine."""

from __future__ import annotations

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.drafters.recycling import AdjacencyTable, RecyclingDrafter
from fastdecode.errors import ConfigError

PROMPTS = [
    [1] + [30, 31, 32, 33, 34, 35, 36, 37] * 3 + [40, 41],
    [1, 50, 51, 52],
    [1, 20, 21, 22, 23] * 4,
    [1, 9, 8, 7, 6, 5, 4, 3] * 3,
]


class Spy(RecyclingDrafter):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed: list[tuple[list[int], list[list[int]]]] = []

    def observe_topk(self, input_tokens, topk):
        self.fed.append((list(input_tokens), [list(t) for t in topk]))
        super().observe_topk(input_tokens, topk)


def test_the_table_learns_the_targets_own_greedy_choices(tiny_model, tokenizer):
    """Each row fed back is (a committed input token, the target's top candidates after
    it); under greedy decoding the first candidate is the token that followed."""
    drafter = Spy(k=4, width=3)
    engine = Engine(tiny_model, tokenizer)
    result = engine.generate(PROMPTS[0], drafter=drafter, max_new_tokens=30)
    sequence = PROMPTS[0] + result.token_ids
    position = len(PROMPTS[0]) - 1
    assert drafter.fed and drafter.fed[0][0] == [PROMPTS[0][-1]]
    for inputs, topk in drafter.fed:
        assert all(len(t) == 3 and len(set(t)) == 3 for t in topk)
        for token, candidates in zip(inputs, topk):
            assert sequence[position] == token
            assert candidates[0] == sequence[position + 1]
            position += 1
    assert position >= len(sequence) - 2  # every committed row was fed (the last token has no row yet)


@pytest.mark.parametrize("draft_tree", [1, 3, "auto"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_recycling_greedy_equals_plain(tiny_model, tokenizer, draft_tree, max_num_seqs, linear_pass_costs):
    plain = [r.token_ids for r in Engine(tiny_model, tokenizer, max_num_seqs=1).generate(PROMPTS, max_new_tokens=30)]
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("recycling", k=4), max_num_seqs=max_num_seqs)
    for _ in range(2):  # the second round starts with the table the first one filled
        results = engine.generate(PROMPTS, max_new_tokens=30, draft_tree=draft_tree)
        assert [r.token_ids for r in results] == plain
    assert sum(r.acceptance.accepted_tokens for r in results) > 0


def test_recycling_seeded_sampling_equals_plain_sampling(tiny_model, tokenizer):
    options = dict(temperature=0.8, top_p=0.95, seed=5, max_new_tokens=30)
    plain = [r.token_ids for r in Engine(tiny_model, tokenizer, max_num_seqs=1).generate(PROMPTS, **options)]
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("recycling"), max_num_seqs=2)
    assert [r.token_ids for r in engine.generate(PROMPTS, draft_tree=2, **options)] == plain


def test_forks_share_the_table_but_not_the_ngram_memory():
    a = RecyclingDrafter()
    b = a.fork()
    a.begin([1, 2, 3, 1, 2])
    b.begin([7, 8])
    a.observe_topk([4], [[5, 6]])
    assert b.adjacency.next(4) == 5
    assert b.propose([7, 8, 4], 3).tokens[:1] == [5]
    assert a.mln is not b.mln


def test_backoff_order_ngram_then_table_then_bigram():
    d = RecyclingDrafter(n=3, k=4)
    d.begin([10, 11, 12, 13, 10, 11])
    d.observe_topk([12, 13], [[99], [98]])
    # (10, 11) seen before -> 12 (trigram); (11, 12) -> 13 (trigram); (12, 13) -> 10 (trigram) ...
    assert d.propose([10, 11], 3).tokens == [12, 13, 10]
    # after (5, 12): no trigram; the table says 99 after 12
    assert d.propose([5, 12], 1).tokens == [99]
    # after (5, 11): no trigram, no table entry for 11; the bigram 11 -> 12
    assert d.propose([5, 11], 1).tokens == [12]


def test_paths_start_with_the_tables_runner_ups():
    d = RecyclingDrafter(n=3, k=3)
    d.begin([1, 2])
    d.observe_topk([7], [[20, 21, 22, 23]])
    draft = d.propose_paths([6, 7], 3, 3)
    assert draft.tokens[0] == 20
    assert [a[0] for a in draft.alternatives] == [21, 22]


def test_paths_make_a_tree_that_branches_at_every_depth():
    """Runner-ups at depth d after the chain's token before, taken in the order of d + rank:
    (depth 0, 2nd), then (depth 0, 3rd) and (depth 1, 2nd); each with a chain of branch_k."""
    d = RecyclingDrafter(n=3, k=3, branch_k=1)
    d.begin([1, 2])
    d.observe_topk([7, 20, 30, 21], [[20, 21, 22], [30, 31], [40, 41], [50]])
    draft = d.propose_paths([6, 7], 3, 4)
    assert draft.tokens == [20, 30, 40]
    assert draft.alternatives == ([21, 50], [22], [20, 31])
    assert d.propose_paths([6, 7], 3, 1).alternatives == ()


@pytest.mark.parametrize("kwargs", [{"k": 0}, {"width": 0}, {"n": 1}, {"branch_k": -1}])
def test_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        RecyclingDrafter(**kwargs)


def test_adjacency_table_keeps_width():
    t = AdjacencyTable(width=2)
    t.update([3], [[4, 5, 6]])
    assert t.candidates(3) == [4, 5]
