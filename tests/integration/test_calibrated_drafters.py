"""The embedded model drafting for itself through a calibrated compression (``--draft-quant
smoothquant``): a private copy smoothed and quantized to w8a8 layers on the shipped
calibration text drafts for the float32 model, losslessly and mostly accepted. (AWQ takes
the same path but calibrates for ~1.5 minutes on this CPU: checked by hand, not here.)"""

import pytest

from fastdecode import Engine
from fastdecode.drafters.factory import DrafterOptions
from fastdecode.suite import builtin_suite

pytestmark = pytest.mark.integration

PROMPTS = ["What is the capital of France?", next(s.prompt for s in builtin_suite() if s.category == "code")]


def test_a_smoothquant_copy_drafts_for_the_float_model_losslessly(smollm2):
    model, tokenizer = smollm2
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "layernorm" in name}
    drafter = DrafterOptions(name="draft-model", k=4, draft_quant="smoothquant").build(model, tokenizer)
    assert drafter.executor.weights == "w8a8"  # the head included
    # the target's own model is untouched: smoothing rewrote the norms of a private copy
    assert all(p.equal(before[name]) for name, p in model.named_parameters() if name in before)
    plain = Engine(model, tokenizer)
    engine = Engine(model, tokenizer, drafter=drafter)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=32, draft_k=4)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=32).token_ids, prompt[:40]
        drafted += result.acceptance.drafted_tokens
        accepted += result.acceptance.accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.7
