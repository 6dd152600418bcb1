"""KV blocks allocated as requests grow, and preemption when the pool runs out (``engine/scheduler.py``).

A pool too small for every request at once: the most recently admitted request gives its blocks
back and resumes later from its tokens. Every request still gets the tokens it gets alone (greedy
and seeded sampling, with and without a drafter), the oldest request is never preempted, drafts
only take blocks nobody needs, and every block is back in the pool at the end."""

from __future__ import annotations

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.decoding.tokenization import PromptTypeError

PROMPTS = [[1, *range(10 + i, 22 + i)] for i in range(5)]  # 13 tokens each
MAX_NEW = 40
# Blocks of 4 positions; 30 blocks hold 120 positions: two requests at their full 53 positions,
# five only while short, so the later ones are preempted as the earlier grow.
SMALL_POOL = dict(block_size=4, num_kv_blocks=30, max_num_seqs=5)


def _options(sampled: bool, i: int) -> dict:
    options = dict(max_new_tokens=MAX_NEW, min_tokens=MAX_NEW)  # no early end: every request grows to its full length
    return {**options, "temperature": 0.9, "top_k": 30, "seed": 100 + i} if sampled else options


def _run(engine: Engine, specs: list[dict]) -> tuple[list[list[int]], list[int]]:
    """Each request's tokens, and how often each was preempted (read while it ran)."""
    ids = engine.add_requests(specs)
    tokens = {i: [] for i in ids}
    preempted = dict.fromkeys(ids, 0)
    while engine.has_unfinished():
        for request_id in ids:
            if request_id in engine._requests:
                preempted[request_id] = engine.get_request(request_id).num_preemptions
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                assert out.result.token_ids == tokens[out.request_id]
    return [tokens[i] for i in ids], [preempted[i] for i in ids]


def _drafter(kind: str | None):
    return None if kind is None else build_drafter("ngram", n=2, k=6)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_preempted_requests_give_the_tokens_they_give_alone(tiny_model, tokenizer, sampled, drafter):
    specs = [dict(prompt=p, **_options(sampled, i)) for i, p in enumerate(PROMPTS)]
    alone = Engine(tiny_model, tokenizer, drafter=_drafter(drafter), max_num_seqs=1, enable_prefix_caching=False)
    expected = [alone.generate(s["prompt"], **{k: v for k, v in s.items() if k != "prompt"}).token_ids for s in specs]
    engine = Engine(tiny_model, tokenizer, drafter=_drafter(drafter), **SMALL_POOL)
    got, preempted = _run(engine, specs)
    assert got == expected
    assert all(len(t) == MAX_NEW for t in got)
    assert engine.scheduler.num_preemptions > 0 and sum(preempted) > 0  # the pool did run out
    assert preempted[0] == 0  # the oldest request always runs on
    pool = engine.block_pool
    assert pool.num_free == pool.num_blocks and all(c == 0 for c in pool.ref_count)


def test_a_preempted_request_under_an_oracle_drafter_is_identical(
    tiny_model, tokenizer, oracle_drafter, linear_pass_costs
):
    """Long drafts that are always right: each is cut to the blocks left over, never preempting anyone.
    (Fixed pass costs: on a busy machine measured ones declined the drafts, and none was cut.)"""
    plain = Engine(tiny_model, tokenizer)
    references = [p + plain.generate(p, max_new_tokens=MAX_NEW, min_tokens=MAX_NEW).token_ids for p in PROMPTS]
    engine = Engine(tiny_model, tokenizer, **SMALL_POOL)
    drafters = [oracle_drafter(ref) for ref in references]
    specs = [
        dict(prompt=p, drafter=d, draft_k=12, **_options(False, i)) for i, (p, d) in enumerate(zip(PROMPTS, drafters))
    ]
    got, preempted = _run(engine, specs)
    assert got == [ref[len(p) :] for ref, p in zip(references, PROMPTS)]
    assert preempted[0] == 0 and engine.scheduler.num_preemptions > 0
    # the drafts were cut to the room left, never below what the request itself needs
    assert any(k < 12 for d in drafters for k in d.requested_k[1:])
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_request_holds_the_blocks_of_its_tokens_not_of_its_maximum(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, block_size=4, num_kv_blocks=64)
    engine.add_request(PROMPTS[0], max_new_tokens=100, min_tokens=100)  # may reach 113 positions: 29 blocks
    engine.step()  # the prompt (13 positions) and its first new token
    request = next(iter(engine._requests.values()))
    assert len(request.table.blocks) == 4 and request.max_blocks == 29
    for _ in range(5):
        engine.step()
    assert len(request.table.blocks) == engine.block_pool.blocks_for(len(request.context))


def test_many_long_requests_in_a_small_pool_all_finish(tiny_model, tokenizer):
    """More requests than ever fit at once, each as long as the pool allows alone: the oldest runs on,
    the others wait or are preempted, and each finishes with its own tokens."""
    engine = Engine(tiny_model, tokenizer, block_size=4, num_kv_blocks=14, max_num_seqs=4)
    specs = [dict(prompt=p, max_new_tokens=42, min_tokens=42) for p in PROMPTS[:4]]  # 55 positions: 14 blocks each
    alone = Engine(tiny_model, tokenizer, max_num_seqs=1)
    expected = [alone.generate(s["prompt"], max_new_tokens=42, min_tokens=42).token_ids for s in specs]
    got, preempted = _run(engine, specs)
    assert got == expected and preempted[0] == 0


# -- issue 42, item 3: a bad prompt in a batch leaves the engine as it found it ---------------
@pytest.mark.parametrize("bad", [b"x", "", 7])
def test_a_bad_prompt_in_a_batch_queues_nothing(tiny_model, tokenizer, bad):
    engine = Engine(tiny_model, tokenizer)
    with pytest.raises(Exception) as error:
        engine.generate(["Tell me a long story.", bad], max_new_tokens=200)
    assert "prompt 1" in str(error.value)
    if isinstance(bad, bytes):
        assert isinstance(error.value, PromptTypeError)
    assert engine.num_waiting == 0 and not engine.has_unfinished() and not engine._requests
    # and the next call runs only its own prompt, for the steps it needs
    result = engine.generate(["hi"], max_new_tokens=3)[0]
    assert result.num_new_tokens <= 3 and not engine.has_unfinished()


def test_a_request_preempted_within_its_prompt_starts_over_the_same(tiny_model, tokenizer):
    """Preempted while its prompt is being chunked in: sampled against a draft model's q (its random
    stream drawn once), with prompt log-probabilities (scored once), the same as alone."""
    from tiny_models import tiny_llama

    draft_model = tiny_llama(seed=5, vocab_size=96, max_position_embeddings=128, eos_token_id=2, bos_token_id=1)
    long_prompt = [1, *[(7 * i) % 90 + 4 for i in range(59)]]  # 60 tokens, chunked 3 a step
    options = dict(max_new_tokens=10, temperature=0.8, seed=11, prompt_logprobs=2, logprobs=1)

    def run_b(engine: Engine, with_a: bool):
        specs = [dict(prompt=PROMPTS[0], max_new_tokens=60, min_tokens=60)] if with_a else []
        specs.append(dict(prompt=long_prompt, drafter=build_drafter("draft-model", model=draft_model, k=3), **options))
        ids = engine.add_requests(specs)
        results = {}
        preempted = 0
        while engine.has_unfinished():
            if ids[-1] in engine._requests:
                preempted = engine.get_request(ids[-1]).num_preemptions
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out.result
        return results[ids[-1]], preempted

    alone, _ = run_b(Engine(tiny_model, tokenizer, max_num_seqs=1), with_a=False)
    engine = Engine(tiny_model, tokenizer, block_size=4, num_kv_blocks=22, max_num_seqs=2, max_num_batched_tokens=4)
    got, preempted = run_b(engine, with_a=True)
    assert preempted > 0
    assert got.token_ids == alone.token_ids
    assert got.prompt_logprobs == alone.prompt_logprobs and len(got.prompt_logprobs) == len(long_prompt)
    assert got.logprobs == alone.logprobs
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
