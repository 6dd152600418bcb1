"""Continuous batching on a tiny random-weight Llama (and Gemma 3): batch
invariance, the paged KV cache's accounting, admission under a small budget,
prefix caching, aborts, and sampling at batch > 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from stats_helpers import binned_chisquare_pvalue

from fastdecode import Engine, GenerationConfig, build_drafter
from fastdecode.backends import make_target
from fastdecode.decoding.sampling import SamplingParams, probabilities
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.engine import BatchDraftPolicy
from fastdecode.errors import ConfigError

SHARED = [1] + [30, 31, 32, 33, 34, 35, 36, 37] * 5  # a 41-token prefix: two full blocks of 16 and more
PROMPTS = [
    SHARED + [40, 41],
    [1, 50, 51, 52],
    SHARED + [60, 61, 62, 63, 64, 65],
    [1, 20, 21, 22, 23] * 4,
    [1, 70],
    SHARED + [40, 41],  # the same prompt twice
    [1] + list(range(10, 60)),  # 51 tokens: chunked at a small token budget
    [1, 9, 8, 7, 6, 5, 4, 3] * 3,
    [1, 88, 14],
]
# Per prompt: sampling (None: greedy) and drafter ("engine": the engine's n-gram drafter, "none", "draft-model").
SAMPLING = [
    None,
    SamplingParams(0.8, seed=3),
    None,
    SamplingParams(1.0, top_k=20, seed=4),
    None,
    SamplingParams(0.7, top_p=0.9, seed=5),
    None,
    SamplingParams(0.9, seed=6),
    SamplingParams(0.6, seed=7),
]
DRAFTERS = ["engine", "engine", "none", "draft-model", "draft-model", "engine", "none", "engine", "draft-model"]
MAX_NEW = 24


def _add_all(engine: Engine, draft_model, order=None) -> list[str]:
    ids = []
    for i in order or range(len(PROMPTS)):
        options = {} if SAMPLING[i] is None else dataclasses.asdict(SAMPLING[i])
        drafter = (
            {"engine": "engine", "none": None}.get(DRAFTERS[i])
            if DRAFTERS[i] != "draft-model"
            else build_drafter("draft-model", model=draft_model, k=3)
        )
        ids.append(engine.add_request(PROMPTS[i], drafter=drafter, max_new_tokens=MAX_NEW, **options))
    return ids


def _run(engine: Engine, ids: list[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done = set()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                assert out.result.token_ids == tokens[out.request_id]
                done.add(out.request_id)
    assert done == set(ids)
    return tokens


@pytest.fixture(scope="module")
def draft_model():
    from tiny_models import tiny_llama

    # Another random model sharing the vocabulary: its drafts are sometimes right, often wrong.
    return tiny_llama(seed=5, vocab_size=96, max_position_embeddings=128, eos_token_id=2, bos_token_id=1)


@pytest.fixture(scope="module")
def alone(tiny_model, tokenizer, draft_model):
    """Each prompt decoded alone (max_num_seqs 1, whole-prompt chunks, no prefix cache)."""
    engine = Engine(
        tiny_model, tokenizer, drafter=build_drafter("ngram", n=3, k=4), max_num_seqs=1, enable_prefix_caching=False
    )
    out = []
    for i in range(len(PROMPTS)):
        (rid,) = _add_all(engine, draft_model, order=[i])
        out.append(_run(engine, [rid])[rid])
    return out


@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(1, 256), (3, 16), (8, 256), (8, 9)])
def test_batch_invariance(tiny_model, tokenizer, draft_model, alone, max_num_seqs, max_num_batched_tokens):
    """Every request gets exactly the tokens it gets alone, whatever shares its passes,
    however its prompt is chunked, with prefix-cache hits, greedy or seeded sampling,
    with no drafter, the n-gram drafter or a draft model."""
    engine = Engine(
        tiny_model,
        tokenizer,
        drafter=build_drafter("ngram", n=3, k=4),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    ids = _add_all(engine, draft_model)
    tokens = _run(engine, ids)
    assert [tokens[i] for i in ids] == alone
    assert all(len(t) > 0 for t in alone)
    if max_num_seqs == 1:  # the shared prefix was cached by the first request and hit by later ones
        assert engine.block_pool.prefix_hits_tokens >= 2 * 32
    assert engine.block_pool.num_free == engine.block_pool.num_blocks  # every block back


def test_generate_list_matches_one_by_one_and_keeps_input_order(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"), max_num_seqs=4)
    prompts = [p for p in PROMPTS[:6]]
    batched = engine.generate(prompts, max_new_tokens=16)
    single = [engine.generate(p, max_new_tokens=16) for p in prompts]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.num_prompt_tokens for r in batched] == [len(p) for p in prompts]
    # each request counts the decode passes it took part in: its own steps, whoever shared them
    for r in [*batched, *single]:
        assert r.decode_passes == r.acceptance.steps and (r.decode_pass_s > 0) == (r.decode_passes > 0)
    assert sum(r.decode_passes for r in batched) > max(r.decode_passes for r in batched)


@pytest.mark.parametrize("model_kind", ["torch-kernels", "gemma3"])
def test_batch_invariance_other_layer_paths(tokenizer, model_kind):
    """The torch-op layer path (float_kernel="torch") and Gemma 3's sliding windows, batched."""
    from tiny_models import tiny_gemma3, tiny_llama

    if model_kind == "gemma3":
        model = tiny_gemma3(seed=1)
        target = make_target(model, "native")
    else:
        model = tiny_llama(seed=2)
        target = make_target(model, "native", float_kernel="torch")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[6]]
    alone = []
    for p in prompts:
        engine = Engine(model, tokenizer, target=target, drafter=build_drafter("ngram", n=3, k=3), max_num_seqs=1)
        alone.append(engine.generate(p, max_new_tokens=12).token_ids)
        engine.free_kv_cache()
    engine = Engine(
        model,
        tokenizer,
        target=target,
        drafter=build_drafter("ngram", n=3, k=3),
        max_num_seqs=4,
        max_num_batched_tokens=10,
    )
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=12)] == alone


def test_two_streams_iterated_alternately_do_not_corrupt_each_other(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"))
    expected = [engine.generate(p, max_new_tokens=20).token_ids for p in (PROMPTS[0], PROMPTS[3])]
    a, b = engine.stream(PROMPTS[0], max_new_tokens=20), engine.stream(PROMPTS[3], max_new_tokens=20)
    got = [[], []]
    iters = [iter(a), iter(b)]
    live = [True, True]
    while any(live):
        for j in (0, 1):
            if live[j]:
                step = next(iters[j], None)
                if step is None:
                    live[j] = False
                else:
                    got[j].extend(step.token_ids)
    assert got == expected
    assert a.result.token_ids == expected[0] and b.result.token_ids == expected[1]


def test_abort_and_finish_free_every_block(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"), max_num_seqs=2, num_kv_blocks=40)
    pool = engine.block_pool
    ids = [engine.add_request(p, max_new_tokens=30) for p in PROMPTS[:5]]
    for _ in range(3):
        engine.step()
    assert pool.num_free < pool.num_blocks and engine.num_running == 2 and engine.num_waiting == 3
    engine.abort(ids[0])  # running
    engine.abort(ids[4])  # waiting
    engine.abort("no-such-request")  # ignored
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert set(finished) == set(ids[1:4])
    assert pool.num_free == pool.num_blocks
    assert all(c == 0 for c in pool.ref_count)


def test_abandoned_stream_frees_its_request(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer)
    stream = engine.stream(PROMPTS[1], max_new_tokens=40)
    it = iter(stream)
    next(it), next(it)
    it.close()  # the consumer walked away
    assert not engine.has_unfinished()
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_small_kv_budget_completes_every_request_with_the_same_output(tiny_model, tokenizer, alone, draft_model):
    """Room for about two requests at a time: the others wait; nothing crashes, nothing is dropped."""
    engine = Engine(
        tiny_model,
        tokenizer,
        drafter=build_drafter("ngram", n=3, k=4),
        max_num_seqs=8,
        num_kv_blocks=9,
        enable_prefix_caching=False,
    )
    ids = _add_all(engine, draft_model)
    max_running = 0
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        max_running = max(max_running, engine.num_running)
    assert [tokens[i] for i in ids] == alone
    assert 1 <= max_running < 8


def test_a_request_larger_than_the_whole_cache_is_refused(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, num_kv_blocks=2)  # 32 positions
    with pytest.raises(ConfigError, match="KV blocks"):
        engine.add_request(PROMPTS[0], max_new_tokens=10)
    assert engine.generate(PROMPTS[1], max_new_tokens=10).num_new_tokens > 0


def test_prefix_cache_hit_gives_identical_output_and_is_counted(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer)
    cold = Engine(tiny_model, tokenizer, enable_prefix_caching=False)
    first = engine.generate(PROMPTS[0], max_new_tokens=12)
    assert first.num_cached_prompt_tokens == 0
    second = engine.generate(PROMPTS[2], max_new_tokens=12)  # shares SHARED's two full blocks
    assert second.num_cached_prompt_tokens == 32
    assert engine.block_pool.prefix_hits_tokens == 32
    assert engine.block_pool.prefix_queries_tokens == len(PROMPTS[0]) + len(PROMPTS[2])
    assert second.token_ids == cold.generate(PROMPTS[2], max_new_tokens=12).token_ids
    # The whole prompt cached (its generated tokens too): the last prompt token is still computed.
    again = engine.generate(PROMPTS[0], max_new_tokens=12)
    assert again.token_ids == first.token_ids and again.num_cached_prompt_tokens == 32


def test_ngram_sampling_gives_plain_sampling_tokens(tiny_model, tokenizer):
    """Draws keyed by position: with a deterministic drafter, seeded speculative
    sampling reproduces plain seeded sampling token for token."""
    plain = Engine(tiny_model, tokenizer)
    spec = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", n=3, k=4))
    for seed in range(5):
        options = dict(temperature=0.9, seed=seed, max_new_tokens=30)
        assert spec.generate(PROMPTS[3], **options).token_ids == plain.generate(PROMPTS[3], **options).token_ids


class ConstantDrafter(Drafter):
    name = "constant"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, context, k):
        return Draft(self.tokens[:k])


def test_sampling_at_batch_size_8_matches_the_target_distribution(tiny_model, tokenizer):
    """Requests with different seeds decoded 8 at a time, drafting a constant token
    (accepted about half the time): the second token follows the target's marginal."""
    params = SamplingParams(temperature=0.01, top_k=8)
    prompt = [1] + [20, 21, 22, 23] * 6
    with torch.no_grad():
        p1 = probabilities(tiny_model(torch.tensor([prompt])).logits[0, -1:], params)[0]  # [V]
        firsts = p1.nonzero()[:, 0].tolist()
        p2 = probabilities(tiny_model(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1], params)
    marginal2 = p1[firsts] @ p2  # [V]
    engine = Engine(tiny_model, tokenizer, drafter=ConstantDrafter([5, 5]), max_num_seqs=8)

    class DraftToTheCaps(BatchDraftPolicy):  # the subject here is sampling, not whether drafting pays
        def plan(self, base_rows, requests, made=False, max_rows=None):
            return [cap for _, cap in requests]

    engine.policy = DraftToTheCaps()
    runs = 800
    config = GenerationConfig(max_new_tokens=3, draft_k=2)  # the second step drafts token 2
    ids = [
        engine.add_request(prompt, config=dataclasses.replace(config, sampling=dataclasses.replace(params, seed=s)))
        for s in range(runs)
    ]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    accepted = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
            accepted += out.num_accepted
    results = [outputs[i] for i in ids]
    assert all(len(r) == 3 for r in results)
    assert accepted > runs * 0.2
    assert binned_chisquare_pvalue([r[0] for r in results], p1) > 0.001
    assert binned_chisquare_pvalue([r[1] for r in results], marginal2) > 0.001
    wrong = marginal2.clone()  # negative control: the drafted token's weight inflated
    wrong[5] += 0.15
    assert binned_chisquare_pvalue([r[1] for r in results], wrong) < 0.001


def test_per_request_options(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"))
    a = engine.add_request(PROMPTS[3], max_new_tokens=10, speculate=False)
    b = engine.add_request(PROMPTS[3], max_new_tokens=5)
    drafted = {a: 0, b: 0}
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            drafted[out.request_id] += out.num_drafted
            if out.finished:
                results[out.request_id] = out.result
    assert drafted[a] == 0 and results[a].drafter == "none" and results[a].num_new_tokens == 10
    assert results[b].num_new_tokens == 5 and results[b].drafter == "ngram"
    assert results[b].token_ids == results[a].token_ids[:5]
    with pytest.raises(ConfigError):
        engine.add_request(PROMPTS[0], request_id="x", temperature=-1)
    engine.add_request(PROMPTS[0], request_id="x")
    with pytest.raises(ConfigError, match="already in use"):
        engine.add_request(PROMPTS[0], request_id="x")


def test_engine_options_are_validated(tiny_model, tokenizer):
    for bad in (
        dict(max_num_seqs=0),
        dict(kv_cache_gb=-1),
        dict(num_kv_blocks=0),
        dict(block_size=0),
        dict(kv_cache_gb=1, num_kv_blocks=10),
        dict(max_num_seqs=8, max_num_batched_tokens=4),
    ):
        with pytest.raises(ConfigError):
            Engine(tiny_model, tokenizer, **bad)


def test_engine_leaves_the_users_model_unchanged(tokenizer):
    """A native target fuses projections for its kernels; the model the user passed
    must still compute what it computed before."""
    from tiny_models import tiny_llama

    model = tiny_llama(seed=9)
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    Engine(model, tokenizer, drafter=build_drafter("ngram")).generate(PROMPTS[3], max_new_tokens=8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_uninitialized_kv_memory_is_never_read(tokenizer):
    """The KV pool is allocated uninitialized (torch.empty); filled with NaN first, every
    request must decode exactly as on a fresh pool (a read of an unwritten slot would
    turn its logits into NaN)."""
    from tiny_models import tiny_llama

    model = tiny_llama(3)
    prompts = [PROMPTS[0], PROMPTS[6], PROMPTS[3]]
    reference = Engine(model, tokenizer, max_num_seqs=3).generate(prompts, max_new_tokens=20)
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram"), max_num_seqs=3, max_num_batched_tokens=16)
    cache = engine._cache()
    for t in (*cache.k, *cache.v):
        t.fill_(float("nan"))
    got = engine.generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in got] == [r.token_ids for r in reference]


def test_two_thousand_token_stream_equals_one_decode_of_the_output(smollm2_tokenizer):
    """A 2,000-token sampled stream through the engine with the real tokenizer (random
    tokens: many split multi-byte characters): the streamed pieces join to exactly the
    decode of all output tokens, and no decode call grows with the output's length."""
    from tiny_models import tiny_llama

    model = tiny_llama(
        5, vocab_size=len(smollm2_tokenizer), max_position_embeddings=2100, hidden_size=16, intermediate_size=32
    )
    calls: list[int] = []
    decode = smollm2_tokenizer.decode

    class Counting:
        def __getattr__(self, name):
            return getattr(smollm2_tokenizer, name)

        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return decode(ids, **kwargs)

    engine = Engine(model, Counting(), drafter=build_drafter("ngram"), max_num_seqs=2)
    stream = engine.stream([1, 504, 3000, 12], max_new_tokens=2000, temperature=1.0, seed=2)
    text = "".join(step.text for step in stream)
    result = stream.result
    assert result.num_new_tokens == 2000, result.finish_reason
    assert text == result.text == decode(result.token_ids, skip_special_tokens=True)
    assert max(calls) <= 32, max(calls)


@pytest.mark.parametrize("weights", ["float", "q4_0"])
def test_float16_kv_cache_speculation_and_batching_equal_plain_decoding_alone(tiny_model, tokenizer, weights):
    """With a float16 KV cache: n-gram drafting equals plain decoding, and a batch with chunked
    prefill equals each prompt alone (its numeric model is its own; these hold within it)."""
    target = make_target(tiny_model, "native", weights, kv_cache_dtype="float16")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
    plain = []
    for p in prompts:
        engine = Engine(tiny_model, tokenizer, target=target, max_num_seqs=1)
        plain.append(engine.generate(p, max_new_tokens=16).token_ids)
        engine.free_kv_cache()
    engine = Engine(
        tiny_model,
        tokenizer,
        target=target,
        drafter=build_drafter("ngram", n=3, k=4),
        max_num_seqs=3,
        max_num_batched_tokens=10,
    )
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=16)] == plain
    assert engine.target.new_kv_cache(1).k[0].dtype == torch.float16


def test_long_prefill_token_threshold_caps_a_prompt_while_others_decode(tiny_model, tokenizer):
    """A prompt that joins decoding requests advances at most N tokens a step (it may take the
    whole budget when nothing decodes), and every output still equals the prompt decoded alone."""
    alone = []
    for p in (PROMPTS[1], PROMPTS[6]):
        engine = Engine(tiny_model, tokenizer, max_num_seqs=1)
        alone.append(engine.generate(p, max_new_tokens=12).token_ids)
    engine = Engine(
        tiny_model,
        tokenizer,
        drafter=build_drafter("ngram", n=3, k=3),
        max_num_seqs=2,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=8,
    )
    first = engine.add_request(PROMPTS[1], max_new_tokens=12)
    tokens = {first: [t for out in engine.step() for t in out.token_ids]}  # the short prompt alone, prefilled whole
    second = engine.add_request(PROMPTS[6], max_new_tokens=12)  # 51 tokens, joining a decoding request
    tokens[second] = []
    progress = []
    while engine.has_unfinished():
        before = {r.request_id: (r.prefilling, r.num_computed) for r in engine._running}
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        after = {r.request_id: r.num_computed for r in engine._running}
        if before.get(second, (False,))[0] and second in after and not before.get(first, (True,))[0]:
            progress.append(after[second] - before[second][1])  # prompt tokens it took while the other decoded
    assert progress and max(progress) <= 8
    assert [tokens[first], tokens[second]] == alone


def test_long_prefill_token_threshold_must_be_positive(tiny_model, tokenizer):
    with pytest.raises(ConfigError, match="long_prefill_token_threshold"):
        Engine(tiny_model, tokenizer, long_prefill_token_threshold=0)


def test_the_targets_own_blocks_draft_in_its_kv_cache_at_any_batch_size(tiny_model, tokenizer, linear_pass_costs):
    """The target drafting for itself from its Q4_0 blocks drafts in the engine's paged cache
    (Drafter.attach_kv): no cache or prefill of its own, its rows written in each request's
    blocks past the context, where the verification pass overwrites them."""
    from fastdecode.drafters.factory import DrafterOptions

    plain = Engine(tiny_model, tokenizer, max_num_seqs=1)
    want = [plain.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]
    for max_num_seqs in (1, 4):
        drafter = DrafterOptions(name="draft-model", k=3, draft_quant="q4_0").build(tiny_model, tokenizer)
        own_cache_calls = []
        drafter.draft.forward = lambda *a, calls=own_cache_calls: calls.append(a)  # (forks copy it)
        engine = Engine(tiny_model, tokenizer, drafter=drafter, max_num_seqs=max_num_seqs)
        got = engine.generate(PROMPTS, max_new_tokens=24, speculation_guard=False)  # (drafting is the subject)
        assert [r.token_ids for r in got] == want
        # (at batch > 1 the cost model decides who drafts: on a tiny model a draft token may not pay)
        assert sum(r.acceptance.accepted_tokens for r in got) > 0 and own_cache_calls == []
        assert engine.block_pool.num_free == engine.block_pool.num_blocks  # the draft rows' blocks came back too
