"""Log-probabilities from the engine: the target's, from the pass that verified each token,
whatever the drafter; prompt log-probabilities equal a plain forward's."""

from __future__ import annotations

import pytest
import torch

from fastdecode import Engine, build_drafter
from fastdecode.errors import ConfigError

PROMPT = [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21]


def _drafter(name, tiny_model):
    if name is None:
        return None
    if name in ("draft-model", "hybrid"):
        from tiny_models import tiny_llama

        return build_drafter(name, model=tiny_llama(7), k=3)
    if name == "layer-skip":
        return build_drafter(name, model=tiny_model, k=3)
    return build_drafter(name, k=3)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_prompt_logprobs_are_the_models_log_softmax(tiny_model, tokenizer, backend):
    from fastdecode.backends import make_target

    target = make_target(tiny_model, backend)  # native: the prompt in 3 chunks of 4
    engine = Engine(tiny_model, tokenizer, target=target, max_num_seqs=1, max_num_batched_tokens=4)
    result = engine.generate(PROMPT, max_new_tokens=2, prompt_logprobs=2, logprobs=0)
    with torch.inference_mode():
        logp = torch.log_softmax(tiny_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    entries = result.prompt_logprobs
    assert entries[0].logprob is None and entries[0].token_id == PROMPT[0] and len(entries) == len(PROMPT)
    for i, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == PROMPT[i]
        assert entry.logprob == pytest.approx(float(logp[i - 1, PROMPT[i]]), abs=1e-4)
        assert [t for t, _, _ in entry.top] == logp[i - 1].topk(2).indices.tolist()
    assert [e.token_id for e in result.logprobs] == result.token_ids
    assert result.logprobs[0].top == ()


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer)
    long_prompt = [1] + list(range(10, 50))
    engine.generate(long_prompt, max_new_tokens=1)
    again = engine.generate(long_prompt, max_new_tokens=1, prompt_logprobs=0)
    assert again.num_cached_prompt_tokens == 0 and len(again.prompt_logprobs) == len(long_prompt)


@pytest.mark.parametrize(
    "name", ["ngram", "prompt-lookup", "suffix", "recycling", "draft-model", "layer-skip", "hybrid"]
)
def test_logprobs_are_the_targets_under_every_drafter(tiny_model, tokenizer, name):
    plain = Engine(tiny_model, tokenizer).generate(PROMPT, max_new_tokens=16, logprobs=3)
    spec = Engine(tiny_model, tokenizer, drafter=_drafter(name, tiny_model)).generate(
        PROMPT, max_new_tokens=16, logprobs=3
    )
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_are_refused(tiny_model, tokenizer, value):
    with pytest.raises(ConfigError, match="logprobs"):
        Engine(tiny_model, tokenizer).add_request(PROMPT, logprobs=value)
