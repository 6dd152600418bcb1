"""The embedded real model: fastdecode's output is transformers' output."""

import pytest
import torch

from fastdecode import Engine, build_drafter
from fastdecode.data.suite import builtin_suite
from fastdecode.errors import PromptTooLongError

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    next(s.prompt for s in builtin_suite() if s.category == "summarize"),
    next(s.prompt for s in builtin_suite() if s.category == "code"),
]


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer)
    return {p: engine.generate(p, max_new_tokens=64) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_equals_transformers_generate(smollm2, plain_outputs, prompt):
    model, tokenizer = smollm2
    ids = Engine(model, tokenizer).encode(prompt)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids) :].tolist()
    assert plain_outputs[prompt].token_ids == ref


DRAFTERS = [
    ("ngram", {}, {}),
    ("ngram", {"n": 3}, {"draft_k": 3, "adaptive_k": True}),
    ("ngram", {"min_count": 2, "min_prob": 0.3}, {"draft_k": 10}),
    ("prompt-lookup", {}, {"draft_k": 5}),
]


@pytest.mark.parametrize("name,drafter_options,options", DRAFTERS)
def test_every_drafter_is_token_identical_to_plain(smollm2, plain_outputs, name, drafter_options, options):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, drafter=build_drafter(name, **drafter_options))
    rejected = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=64, **options)
        assert result.token_ids == plain_outputs[prompt].token_ids, prompt[:40]
        assert result.text == plain_outputs[prompt].text
        rejected += result.acceptance.drafted_tokens - result.acceptance.accepted_tokens
    assert rejected > 0  # the prompts exercise rollback, not only full acceptance


def test_ngram_drafts_are_accepted_on_a_document_task(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram"))
    result = engine.generate(PROMPTS[3], max_new_tokens=64)
    assert result.acceptance.accepted_tokens > 0
    assert result.acceptance.tau > 1.0


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_sampling_is_reproducible_for_a_seed(smollm2, drafter):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, drafter=build_drafter(drafter) if drafter else None)
    runs = [engine.generate(PROMPTS[1], max_new_tokens=32, temperature=0.9, top_p=0.95, seed=s) for s in (7, 7, 8)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids


def test_prompt_longer_than_the_context_is_refused(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer)
    long_prompt = "word " * (model.config.max_position_embeddings + 10)
    with pytest.raises(PromptTooLongError, match="context length is 8192"):
        engine.generate(long_prompt, max_new_tokens=4)


def test_stop_string_and_streaming(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram"))
    full = engine.generate(PROMPTS[1], max_new_tokens=64)
    stop = full.text[20:26]
    stream = engine.stream(PROMPTS[1], max_new_tokens=64, stop=(stop,))
    pieces = [step.text for step in stream]
    assert stream.result.finish_reason == "stop"
    assert stream.result.text == full.text[: full.text.find(stop)]
    assert "".join(pieces) == stream.result.text
