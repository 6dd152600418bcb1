"""Several candidate paths per step (``draft_tree``): the main chain and alternatives
verified in one pass on copy-on-write block tables; the path accepted furthest is kept.
Greedy and seeded-sampling outputs must equal plain decoding exactly."""

from __future__ import annotations

import pytest
from engine_spy import record_passes
from stats_helpers import DraftToTheCaps

from fastdecode import Engine, GenerationConfig, build_drafter
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.drafters.ngram import MultiLevelNGram
from fastdecode.errors import ConfigError

PROMPTS = [
    [1] + [30, 31, 32, 33, 34, 35, 36, 37] * 5 + [40, 41],
    [1, 50, 51, 52],
    [1, 20, 21, 22, 23] * 4,
    [1] + list(range(10, 60)),
    [1, 9, 8, 7, 6, 5, 4, 3] * 3,
]


class PathsOracle(Drafter):
    """Main chain: the reference continuation with its first token corrupted (always
    rejected at once). Alternatives: the true continuation, cut to ``good_len``, and a
    wrong one. So the true alternative is kept at every step it fits."""

    name = "paths-oracle-test"

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, good_len: int = 3) -> None:
        self.references, self.vocab_size, self.good_len = references, vocab_size, good_len
        self.reference: list[int] = []

    def begin(self, prompt_ids):
        self.reference = self.references[tuple(prompt_ids)]

    def propose(self, context, k):
        rest = self.reference[len(context) :][:k]
        return Draft([(rest[0] + 1) % self.vocab_size, *rest[1:]] if rest else [])

    def propose_paths(self, context, k, num_paths):
        main = self.propose(context, k)
        rest = self.reference[len(context) :][: min(k, self.good_len)]
        if not rest:
            return main
        wrong = [(rest[0] + 2) % self.vocab_size] * len(rest)
        return Draft(main.tokens, alternatives=(wrong, rest)[: num_paths - 1][::-1])


def _step_until_done(engine, requests, **options):
    """Add (prompt, drafter) requests, step the engine until all finish; their results in order."""
    ids = [engine.add_request(p, drafter=d, **options) for p, d in requests]
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.result
    return [results[i] for i in ids]


def _plain(model, tokenizer, prompts, **options):
    engine = Engine(model, tokenizer, max_num_seqs=1)
    return [r.token_ids for r in engine.generate(prompts, max_new_tokens=24, **options)]


@pytest.mark.parametrize("draft_tree", [2, 3, "auto"])
@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(1, 256), (5, 256), (5, 12)])
def test_ngram_paths_greedy_equal_plain(tiny_model, tokenizer, draft_tree, max_num_seqs, max_num_batched_tokens):
    expected = _plain(tiny_model, tokenizer, PROMPTS)
    engine = Engine(
        tiny_model,
        tokenizer,
        drafter=build_drafter("ngram", n=3, k=4),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    engine.policy = DraftToTheCaps()
    results = engine.generate(PROMPTS, max_new_tokens=24, draft_tree=draft_tree)
    assert [r.token_ids for r in results] == expected
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    if draft_tree != "auto":  # (auto verifies them only while they pay)
        assert sum(r.acceptance.alternative_tokens for r in results) > 0


def test_ngram_paths_seeded_sampling_equals_plain_sampling(tiny_model, tokenizer):
    options = dict(temperature=0.9, top_k=30, seed=17)
    expected = _plain(tiny_model, tokenizer, PROMPTS, **options)
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", n=2, k=3), max_num_seqs=3)
    engine.policy = DraftToTheCaps()
    results = engine.generate(PROMPTS, max_new_tokens=24, draft_tree=3, **options)
    assert [r.token_ids for r in results] == expected
    assert sum(r.acceptance.alternative_tokens for r in results) > 0


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_kept_alternative_path_takes_over_the_request(tiny_model, tokenizer, max_num_seqs):
    """The main chain is always wrong and an alternative is right: the alternative's
    blocks (copied mid-block, shared before) become the request's, every step gains
    its tokens, and the output is still plain decoding's."""
    expected = _plain(tiny_model, tokenizer, PROMPTS[:3])
    references = {tuple(p): list(p) + e for p, e in zip(PROMPTS[:3], expected)}
    engine = Engine(tiny_model, tokenizer, max_num_seqs=max_num_seqs, block_size=4)
    engine.policy = DraftToTheCaps()
    # (no guard: on a request alone it pauses a few steps to time the plain pass, which the step count below ignores)
    got = _step_until_done(
        engine,
        [(p, PathsOracle(references, 96)) for p in PROMPTS[:3]],
        max_new_tokens=24,
        draft_tree=3,
        speculation_guard=False,
    )
    assert [r.token_ids for r in got] == expected
    for r in got:
        assert r.acceptance.steps >= 2 and r.acceptance.alternative_wins >= r.acceptance.steps - 1
        assert r.acceptance.alternative_extra_tokens == r.acceptance.accepted_tokens  # the main chain never scored
        assert r.acceptance.tau > 2.5  # 3 accepted + a bonus on most steps
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert all(c == 0 for c in engine.block_pool.ref_count)


def test_one_path_is_the_plain_chain(tiny_model, tokenizer):
    """draft_tree=1 never asks for paths: the drafter's propose_paths is not called."""
    calls = []

    class Spy(PathsOracle):
        def propose_paths(self, context, k, num_paths):
            calls.append(num_paths)
            return super().propose_paths(context, k, num_paths)

    expected = _plain(tiny_model, tokenizer, PROMPTS[:1])
    engine = Engine(tiny_model, tokenizer)
    result = engine.generate(PROMPTS[0], drafter=None, max_new_tokens=24)
    assert result.token_ids == expected[0]
    references = {tuple(PROMPTS[0]): list(PROMPTS[0]) + expected[0]}
    rid = engine.add_request(PROMPTS[0], drafter=Spy(references, 96), max_new_tokens=24)
    while engine.has_unfinished():
        engine.step()
    assert calls == [] and rid


def test_mln_candidates_rank_by_count():
    mln = MultiLevelNGram(3)
    mln.initialize([5, 6, 7, 5, 6, 8, 5, 6, 7, 5, 6, 9])
    assert mln.candidates([5, 6], 3) == [7, 9, 8]  # 7 twice; 8 and 9 once each, the later-seen first
    assert mln.candidates([5, 6], 1) == [7]
    assert mln.candidates([4, 4], 2) == []


@pytest.mark.parametrize("value", [0, -1, "wide", True, 1.5])
def test_draft_tree_option_is_validated(value):
    with pytest.raises(ConfigError, match="draft_tree"):
        GenerationConfig(draft_tree=value)


def test_alternative_paths_do_not_evict_the_prefix_cache(tiny_model, tokenizer):
    """Scratch blocks of draft paths are reused before any cached block is evicted: a
    prefix cached by a finished request is still hit after many steps with alternatives."""
    engine = Engine(
        tiny_model, tokenizer, drafter=build_drafter("ngram", n=2, k=3), max_num_seqs=1, num_kv_blocks=64, block_size=4
    )
    shared = PROMPTS[0][:33]
    engine.generate(shared + [60], max_new_tokens=4, drafter=None)  # caches 8 full blocks
    alternatives = 0
    for p in (PROMPTS[1], PROMPTS[2], PROMPTS[4]):  # 48 blocks at most: fewer than the 55 never cached
        alternatives += engine.generate(p, max_new_tokens=40, draft_tree=3).acceptance.alternative_tokens
    assert alternatives > 0
    hits = engine.block_pool.prefix_hits_tokens
    result = engine.generate(shared + [61], max_new_tokens=2, drafter=None)
    assert result.num_cached_prompt_tokens == 32 and engine.block_pool.prefix_hits_tokens - hits == 32


class TreeOracle(PathsOracle):
    """A token tree that branches deep: the main chain is the reference continuation with
    its token at depth ``wrong_at`` corrupted; one alternative shares the main chain up to
    there and then follows the reference (``len(alternative) - wrong_at`` rows of its own);
    another branches off it one node later with a wrong token (one row of its own)."""

    name = "tree-oracle-test"

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, wrong_at: int = 2) -> None:
        super().__init__(references, vocab_size)
        self.wrong_at = wrong_at

    def propose(self, context, k):
        rest = self.reference[len(context) :][:k]
        return Draft([t if i != self.wrong_at else (t + 1) % self.vocab_size for i, t in enumerate(rest)])

    def propose_paths(self, context, k, num_paths):
        main = self.propose(context, k)
        rest = self.reference[len(context) :][:k]
        if len(rest) <= self.wrong_at + 1:
            return main
        right = rest
        wrong = [*rest[: self.wrong_at + 1], (rest[self.wrong_at + 1] + 3) % self.vocab_size]
        return Draft(main.tokens, alternatives=(right, wrong)[: num_paths - 1])


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_tree_nodes_are_rows_once_and_the_output_is_plain(tiny_model, tokenizer, max_num_seqs):
    """Paths that share a prefix are verified as a tree: the pass has one row per node (the
    shared prefix's keys and values copied into each path's blocks), the deep alternative
    wins every full step, and the output is plain decoding's."""
    expected = _plain(tiny_model, tokenizer, PROMPTS[:3])
    references = {tuple(p): list(p) + e for p, e in zip(PROMPTS[:3], expected)}
    engine = Engine(tiny_model, tokenizer, max_num_seqs=max_num_seqs, block_size=4)
    engine.policy = DraftToTheCaps()
    passes = record_passes(engine, lambda entries: [(len(e.token_ids), len(e.shared)) for e in entries])
    got = _step_until_done(
        engine, [(p, TreeOracle(references, 96)) for p in PROMPTS[:3]], max_new_tokens=24, draft_k=5, draft_tree=3
    )
    assert [r.token_ids for r in got] == expected
    # a full tree: main (root + 5), right (3 shared: root + 2; 3 own), wrong (4 shared: root + 3 of right's; 1 own)
    full_trees = [p for p in passes if (6, 0) in p and (3, 3) in p and (1, 4) in p]
    assert full_trees
    for r in got:
        assert r.acceptance.alternative_wins >= 1
        assert r.acceptance.alternative_tokens <= 4 * r.acceptance.steps  # the tree's own nodes: 3 + 1 at most
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    assert all(c == 0 for c in engine.block_pool.ref_count)


def test_tree_prefix_and_nodes():
    from fastdecode.engine.tree import tree_nodes, tree_prefix

    assert tree_prefix([1, 2, 3], [[1, 2, 9], [1, 2, 3, 4]]) == (3, 1)
    assert tree_prefix([1, 2, 3], [[1, 5], [1, 2, 9]]) == (2, 1)
    assert tree_prefix([7], [[1, 2]]) == (0, 0)
    draft = Draft([1, 2, 3], alternatives=([1, 2, 4, 5], [1, 6], [1, 2, 4, 7]))
    assert tree_nodes(draft) == 2 + 1 + 1


def test_an_alternative_inside_an_earlier_path_is_dropped(tiny_model, tokenizer):
    class Prefixes(Drafter):
        name = "prefix-alternatives-test"

        def propose(self, context, k):
            return Draft([5, 6, 7][:k])

        def propose_paths(self, context, k, num_paths):
            return Draft([5, 6, 7][:k], alternatives=([5, 6], [5, 8], [5, 8], [5]))

    engine = Engine(tiny_model, tokenizer, max_num_seqs=1)
    engine.policy = DraftToTheCaps()
    seen = record_passes(engine, list)
    result = engine.generate(PROMPTS[1], drafter=Prefixes(), max_new_tokens=12, draft_k=3, draft_tree=5)
    assert result.token_ids == _plain(tiny_model, tokenizer, PROMPTS[1:2])[0][:12]
    trees = [entries for entries in seen if len(entries) > 1]
    # [5, 6] and [5] lie inside the main chain and the second [5, 8] repeats the first: one branch, one row
    assert trees and all(len(entries) == 2 and list(entries[1].token_ids) == [8] for entries in trees)
