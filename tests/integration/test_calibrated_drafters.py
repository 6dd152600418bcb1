"""The embedded model drafting for itself through a calibrated compression (``--draft-quant
smoothquant``): a private copy smoothed and quantized to w8a8 layers on the shipped
calibration text drafts for the float32 model, losslessly and mostly accepted. (AWQ takes
the same path but calibrates for ~1.5 minutes on this CPU: checked by hand, not here.)"""

import hashlib

import torch

from fastdecode import Engine
from fastdecode.data.suite import builtin_suite
from fastdecode.drafters.factory import DrafterOptions

PROMPTS = ["What is the capital of France?", next(s.prompt for s in builtin_suite() if s.category == "code")]


def _digests(model) -> dict[str, str]:
    """Each parameter's bytes, hashed (a copy of every parameter would double the model's memory)."""
    return {
        name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def test_a_smoothquant_copy_drafts_for_the_float_model_losslessly(smollm2):
    model, tokenizer = smollm2
    before = _digests(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    drafter = DrafterOptions(name="draft-model", k=4, draft_quant="smoothquant").build(model, tokenizer)
    assert drafter.executor.weights == "w8a8"  # the head included
    # the target's own model is untouched (every parameter, the final norm and the head's tie
    # included): smoothing rewrote the norms and untied the head of a private copy
    assert _digests(model) == before
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings
    plain = Engine(model, tokenizer)
    engine = Engine(model, tokenizer, drafter=drafter)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=32, draft_k=4)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids, prompt[:40]
        drafted += result.acceptance.drafted_tokens
        accepted += result.acceptance.accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.7
