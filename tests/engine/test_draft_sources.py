"""Draft lengths cut by source: a drafter that names where each token came from
(``Draft.sources``) drafts to its cap, and a cost-driven draft length keeps the tokens
whose sources' acceptance pays for their rows. Output is plain decoding's either way."""

from __future__ import annotations

import pytest
from engine_spy import draft_lengths, record_passes

from fastdecode import Engine, build_drafter
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.engine import BatchDraftPolicy

PROMPTS = [[1, 50, 51, 52, 53], [1, 20, 21, 22, 23] * 3]


class SourcedOracle(Drafter):
    """Two tokens of the true continuation labelled "copy", then wrong tokens labelled "guess"."""

    name = "sourced-oracle-test"
    reports_sources = True

    def __init__(self, references, vocab_size: int = 96) -> None:
        self.references, self.vocab_size = references, vocab_size
        self.reference: list[int] = []

    def begin(self, prompt_ids):
        self.reference = self.references[tuple(prompt_ids)]

    def fork(self):
        return SourcedOracle(self.references, self.vocab_size)

    def propose(self, context, k):
        rest = self.reference[len(context) :][:k]
        tokens = [t if i < 2 else (t + 1) % self.vocab_size for i, t in enumerate(rest)]
        return Draft(tokens, sources=tuple("copy" if i < 2 else "guess" for i in range(len(tokens))))


@pytest.fixture
def dear_rows(monkeypatch):
    """A pass costs a quarter of a step more for each row: a token must be likely to pay."""
    monkeypatch.setattr(BatchDraftPolicy, "cost", lambda self, rows: 1.0 + rows / 4)


def test_tokens_from_a_source_that_never_pays_are_cut(tiny_model, tokenizer, dear_rows):
    plain = [r.token_ids for r in Engine(tiny_model, tokenizer, max_num_seqs=1).generate(PROMPTS, max_new_tokens=40)]
    references = {tuple(p): list(p) + e for p, e in zip(PROMPTS, plain)}
    engine = Engine(tiny_model, tokenizer, drafter=SourcedOracle(references), max_num_seqs=2)
    lengths = record_passes(engine, draft_lengths)
    results = engine.generate(PROMPTS, max_new_tokens=40, draft_k=6)
    assert [r.token_ids for r in results] == plain
    late = [n for step in lengths[8:] for n in step]
    assert late and max(late) <= 2 and 2 in late  # the guesses cut, the copies kept
    for r in results:
        sources = r.acceptance.to_dict()["by_source"]
        assert sources["copy"]["accepted"] == sources["copy"]["reached"] > 0
        assert sources.get("guess", {"accepted": 0})["accepted"] == 0


def test_a_fixed_k_at_batch_one_is_not_cut(tiny_model, tokenizer, dear_rows):
    """One request without --cost-aware-k drafts the K it was given (ANPD's setting)."""
    plain = Engine(tiny_model, tokenizer, max_num_seqs=1).generate(PROMPTS[1], max_new_tokens=24).token_ids
    engine = Engine(tiny_model, tokenizer, drafter=SourcedOracle({tuple(PROMPTS[1]): PROMPTS[1] + plain}))
    lengths = record_passes(engine, lambda entries: len(entries[0].token_ids) - 1)
    result = engine.generate(PROMPTS[1], max_new_tokens=24, draft_k=4)
    assert result.token_ids == plain
    assert lengths[1:4] == [4, 4, 4]  # (after the prefill) every step drafts K = 4, guesses included
    assert result.acceptance.by_source["guess"]["drafted"] >= 2 * 3


@pytest.mark.parametrize("name", ["ngram", "recycling"])
def test_ngram_drafters_name_their_sources(name):
    drafter = build_drafter(name, n=3, k=4)
    drafter.begin([5, 6, 7, 5, 6, 8, 9])
    draft = drafter.propose([5, 6, 7, 5, 6, 8, 9, 5, 6], 3)
    assert draft.tokens[:1] == [8] and draft.sources is not None and len(draft.sources) == len(draft.tokens)
    assert draft.sources[0] == "3-gram"  # (5, 6) -> 8, the latest
    assert type(drafter).reports_sources
    assert drafter.propose_paths([5, 6, 7, 5, 6, 8, 9, 5, 6], 3, 2).sources == draft.sources


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_cost_aware_ngram_with_sources_equals_plain(tiny_model, tokenizer, max_num_seqs):
    prompts = PROMPTS + [[1, 9, 8, 7, 6, 5, 4, 3] * 3]
    plain = [r.token_ids for r in Engine(tiny_model, tokenizer, max_num_seqs=1).generate(prompts, max_new_tokens=30)]
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", n=3, k=4), max_num_seqs=max_num_seqs)
    results = engine.generate(prompts, max_new_tokens=30, cost_aware_k=True)
    assert [r.token_ids for r in results] == plain
    assert all(set(r.acceptance.by_source) <= {"3-gram", "2-gram"} for r in results)


def test_cut_drafts_share_the_row_budget(tiny_model, tokenizer, linear_pass_costs):
    """Drafts made to their caps and cut after stay within max_num_batched_tokens, and the
    rows go where they are worth most (every request's first tokens before anyone's fourth),
    not to whichever request drafted first."""
    prompts = [PROMPTS[0], PROMPTS[1], [1, 9, 8, 7, 6, 5, 4, 3] * 3]
    plain = [r.token_ids for r in Engine(tiny_model, tokenizer, max_num_seqs=1).generate(prompts, max_new_tokens=30)]
    references = {tuple(p): list(p) + e for p, e in zip(prompts, plain)}
    engine = Engine(tiny_model, tokenizer, drafter=SourcedOracle(references), max_num_seqs=3, max_num_batched_tokens=9)
    passes = record_passes(engine, draft_lengths)
    results = engine.generate(prompts, max_new_tokens=30, draft_k=6)
    assert [r.token_ids for r in results] == plain
    full = [p for p in passes if len(p) == 3]
    assert full and all(sum(p) + 3 <= 9 for p in full)
    assert any(sum(1 for n in p if n > 0) >= 2 for p in full)  # the budget spread over the requests
