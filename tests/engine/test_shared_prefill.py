"""Prompts that share leading tokens, prefilled in the same pass: the later ones copy the
earlier one's keys and values for the common prefix (``Scheduler._shared_prefix``) instead
of computing them, and everything they produce is bit-identical to prefilling alone."""

from __future__ import annotations

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.engine.scheduler import common_prefix

QUESTION = [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38]
# lm-evaluation-harness's shape: one question, several one-token (and a longer) choices; a copy (best_of);
# the first prompt's 10 tokens are shared by the second, which the third shares in turn (a chain)
PROMPTS = [
    QUESTION[:10] + [60],
    QUESTION + [40],
    QUESTION + [41],
    QUESTION + [42, 43],
    QUESTION + [40],
    [1, 20, 21, 50],
    [2, 3, 4],
]


def _run(engine, prompts, **options):
    return engine.generate(prompts, max_new_tokens=6, **options)


def _rows_fed(engine):
    """Count the rows each forward pass feeds (its own tokens, shared positions excluded)."""
    fed, forward = [], engine.target.forward_batch

    def counting(cache, entries):
        fed.append(sum(len(e.token_ids) for e in entries))
        return forward(cache, entries)

    engine.target.forward_batch = counting
    return fed


@pytest.mark.parametrize("options", [{}, {"prompt_logprobs": 3, "logprobs": 2}])
def test_shared_prefill_gives_the_bits_of_prefilling_alone(tiny_model, tokenizer, options):
    alone = [_run(Engine(tiny_model, tokenizer, max_num_seqs=1), p, **options) for p in PROMPTS]
    engine = Engine(tiny_model, tokenizer, max_num_seqs=8)
    fed = _rows_fed(engine)
    together = _run(engine, PROMPTS, **options)
    # the question once (10 tokens in the first prompt, the rest in the second), then each prompt's own
    # tokens ([1, 20, 21] of the sixth are the question's too)
    assert fed[0] == 11 + 11 + 1 + 2 + 1 + 1 + 3
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs


def test_shared_prefill_under_a_drafter_is_token_identical(tiny_model, tokenizer):
    plain = _run(Engine(tiny_model, tokenizer, max_num_seqs=8), PROMPTS, speculate=False)
    spec = _run(Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", k=3), max_num_seqs=8), PROMPTS)
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]


def test_sampled_copies_share_the_prefill_and_keep_their_own_seeds(tiny_model, tokenizer):
    prompts = [QUESTION] * 4
    alone = [_run(Engine(tiny_model, tokenizer), QUESTION, temperature=1.0, seed=seed).token_ids for seed in range(4)]
    engine = Engine(tiny_model, tokenizer, max_num_seqs=4)
    fed = _rows_fed(engine)
    ids = [engine.add_request(p, max_new_tokens=6, temperature=1.0, seed=s) for s, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.result.token_ids
    assert [done[i] for i in ids] == alone
    assert fed[0] == len(QUESTION) + 3  # copies feed only their last token


def test_prompt_scoring_shares_only_rows_with_logits(tiny_model, tokenizer):
    """A prompt that scores its tokens cannot take rows from one that does not (they have no logits)."""
    engine = Engine(tiny_model, tokenizer, max_num_seqs=2)
    fed = _rows_fed(engine)
    a = engine.add_request(QUESTION + [40], max_new_tokens=1)
    b = engine.add_request(QUESTION + [41], max_new_tokens=1, prompt_logprobs=0)
    engine.step()
    assert fed[0] == 2 * (len(QUESTION) + 1)
    assert {a, b}


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3], 3) == 1
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([9], [1], 1) == 0


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_shared_prefill_copies_a_low_bit_cache_exactly(tokenizer, kv):
    from tiny_models import tiny_llama

    from fastdecode.backends import make_target

    # head_dim 32: rows of one quantized block (tests/engine/test_kv_cache_dtype.py's model)
    model = tiny_llama(0, vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)

    def engine(max_num_seqs):
        target = make_target(model, "native", kv_cache_dtype=kv)
        return Engine(model, tokenizer, target=target, max_num_seqs=max_num_seqs)

    prompts = [QUESTION * 2 + [40], QUESTION * 2 + [41, 42], QUESTION * 2 + [40]]  # two full blocks and more
    alone = [_run(engine(1), p, prompt_logprobs=2) for p in prompts]
    shared = engine(4)
    fed = _rows_fed(shared)
    together = _run(shared, prompts, prompt_logprobs=2)
    assert fed[0] == len(prompts[0]) + 2 + 1
    assert [(r.token_ids, r.prompt_logprobs) for r in alone] == [(r.token_ids, r.prompt_logprobs) for r in together]
