"""The engine over a quantized KV cache (q8_0, q4_0): speculation is token-identical to plain
decoding under the same cache type, a batch equals each request alone, sampling keeps the
target's distribution (with a negative control), and the KV budget counts the real bytes.

The numeric model is the quantized-cache target's own: every pass reads the same rounded
keys and values, so verification over them reproduces plain decoding over them exactly."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from stats_helpers import DraftToTheCaps, binned_chisquare_pvalue
from tiny_models import tiny_llama

from fastdecode import Engine, GenerationConfig, build_drafter
from fastdecode.backends import NativeTarget, PagedSequence, make_target
from fastdecode.decoding.sampling import SamplingParams, probabilities
from fastdecode.drafters.base import Draft, Drafter

VOCAB = 96
EOS = VOCAB - 1  # (the tokenizer fixture's EOS, 2, stops greedy requests too)
PROMPTS = [
    [1] + [30, 31, 32, 33, 34, 35, 36, 37] * 5 + [40, 41],
    [1, 50, 51, 52],
    [1] + [30, 31, 32, 33, 34, 35, 36, 37] * 5 + [60, 61, 62],  # shares two full blocks with the first
    [1, 20, 21, 22, 23] * 4,
    [1] + list(range(10, 60)),  # chunked at a small token budget
]
MAX_NEW = 20


@pytest.fixture(scope="module")
def model():
    # head_dim 32 (two heads over one KV head): rows of one quantized block
    return tiny_llama(
        0,
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def targets(model):
    # q4_0's keys with their calibrated affine (backends/kv_calibration.py), on token ids of the vocabulary
    calibration = [1] + [int(t) for t in torch.randint(3, EOS, (120,), generator=torch.Generator().manual_seed(0))]
    q4_0 = NativeTarget(model, kv_cache_dtype="q4_0", kv_calibration=calibration)
    assert q4_0.key_affine() is not None
    return {"q8_0": make_target(model, "native", kv_cache_dtype="q8_0"), "q4_0": q4_0}


@pytest.fixture(scope="module")
def plain(model, tokenizer, targets):
    """Each prompt decoded alone, greedily, without drafting, per cache type."""
    out = {}
    for kv, target in targets.items():
        engine = Engine(model, tokenizer, target=target, max_num_seqs=1)
        out[kv] = [engine.generate(p, max_new_tokens=MAX_NEW).token_ids for p in PROMPTS]
        engine.free_kv_cache()
    return out


def _drafter(name: str, model):
    if name == "ngram":
        return build_drafter("ngram", n=3, k=4)
    if name == "draft-model":  # a copy of the model, with a float32 cache of its own
        return build_drafter("draft-model", model=copy.deepcopy(model), k=3)
    if name == "self-int8":  # the target's own model in int8, drafting in the target's quantized cache
        return build_drafter("draft-model", model=model, weights="int8", k=3)
    return build_drafter("layer-skip", model=model, exit_layer=1, k=3)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model", "self-int8", "layer-skip"])
def test_greedy_speculation_equals_plain_decoding_under_the_same_cache(model, tokenizer, targets, plain, kv, drafter):
    engine = Engine(model, tokenizer, target=targets[kv], max_num_seqs=1)
    draft = _drafter(drafter, model)
    results = [engine.generate(p, max_new_tokens=MAX_NEW, drafter=draft) for p in PROMPTS]
    engine.free_kv_cache()
    assert [r.token_ids for r in results] == plain[kv]
    assert sum(r.decode_passes for r in results) < sum(r.num_new_tokens - 1 for r in results)  # drafts were taken


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_batch_with_chunked_prefill_and_token_trees_equals_each_prompt_alone(model, tokenizer, targets, plain, kv):
    """Concurrent requests, a prompt chunked across steps, prefix-cached blocks shared between
    requests, and token-tree verification (copies of quantized rows between paths)."""
    engine = Engine(
        model,
        tokenizer,
        target=targets[kv],
        drafter=build_drafter("ngram", n=3, k=4),
        config=GenerationConfig(draft_tree=3),
        max_num_seqs=3,
        max_num_batched_tokens=10,
    )
    assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=MAX_NEW)] == plain[kv]
    assert engine.scheduler.kv_cache.k[0].dtype == torch.uint8


def test_the_kv_budget_counts_the_real_bytes(model, tokenizer, targets):
    """One --kv-cache-gb holds 128 / 34 as many q8_0 blocks as float32 ones (rows of 32 values:
    128 bytes against 32 int8 and an fp16 scale), 128 / 18 as many q4_0 ones."""
    blocks = {}
    for kv in ("float32", "q8_0", "q4_0"):
        target = targets.get(kv) or make_target(model, "native", kv_cache_dtype=kv)
        engine = Engine(model, tokenizer, target=target, kv_cache_gb=0.001)
        blocks[kv] = engine.scheduler.num_blocks()
        assert blocks[kv] == int(0.001 * 2**30 // target.kv_block_bytes(16))
    assert blocks["q8_0"] == int(blocks["float32"] * 128 / 34) and blocks["q4_0"] > 7 * blocks["float32"]


class ConstantDrafter(Drafter):
    name = "constant"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, context, k):
        return Draft(self.tokens[:k])


def test_sampling_under_a_q4_0_cache_keeps_its_distribution(model, targets, eos_variant):
    """Drafting a constant token (the likeliest second token: accepted part of the time), 8
    requests at a time: the second token follows the q4_0-cache target's own marginal, and an
    inflated draft token is detected."""
    target = targets["q4_0"]
    _, tokenizer = eos_variant(EOS)  # the model's EOS, outside this prompt's top 8: three tokens each
    params = SamplingParams(temperature=0.01, top_k=8)
    prompt = [1] + [20, 21, 22, 23] * 6
    p1 = probabilities(PagedSequence(target).forward(prompt, 1), params)[0]  # [V], over the quantized cache
    firsts = p1.nonzero()[:, 0].tolist()
    p2 = torch.stack([probabilities(PagedSequence(target).forward(prompt + [a], 1), params)[0] for a in firsts])
    marginal2 = p1[firsts] @ p2  # [V]
    t = int(marginal2.argmax())
    engine = Engine(model, tokenizer, target=target, drafter=ConstantDrafter([t, t]), max_num_seqs=8)
    engine.policy = DraftToTheCaps()
    runs = 600
    config = GenerationConfig(max_new_tokens=3, draft_k=2)
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
    assert accepted > runs * 0.1
    assert binned_chisquare_pvalue([r[0] for r in results], p1) > 0.001
    assert binned_chisquare_pvalue([r[1] for r in results], marginal2) > 0.001
    wrong = marginal2.clone()  # negative control: the drafted token's weight inflated
    wrong[t] += 0.15
    assert binned_chisquare_pvalue([r[1] for r in results], wrong) < 0.001
