"""The embedded model on its own GGUF blocks (--weights gguf): the file's Q4_1 layers and Q8_0 embedding as LM head."""

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.suite import builtin_suite

pytestmark = pytest.mark.integration


def test_gguf_weights_generate_sensible_text_and_speculation_is_lossless(smollm2):
    model, tokenizer = smollm2
    target = make_target(model, "native", "gguf")
    assert target.weights == "gguf:q4_1+q8_0" and target.kernel_note is None  # every linear layer from the file
    # (with the chat template, float32's own first token wins by 0.08 logits over another: too close to call)
    plain = Engine(model, tokenizer, target=target).generate("The capital of France is", chat=False, max_new_tokens=16)
    assert "Paris" in plain.text
    document = next(s.prompt for s in builtin_suite() if s.category == "code")
    plain = Engine(model, tokenizer, target=make_target(model, "native", "gguf")).generate(document, max_new_tokens=48)
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram"), target=make_target(model, "native", "gguf"))
    result = engine.generate(document, max_new_tokens=48)
    assert result.token_ids == plain.token_ids
    assert result.acceptance.accepted_tokens > 0
