"""The embedded model on its own GGUF blocks (--weights gguf): the file's Q4_1 layers and Q8_0 embedding as LM head."""

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.data.suite import builtin_suite

PROMPTS = ["What is the capital of France?", next(s.prompt for s in builtin_suite() if s.category == "summarize")]


@pytest.fixture(scope="module")
def plain_outputs_float(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer)
    return {p: engine.generate(p, max_new_tokens=32) for p in PROMPTS}


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


def test_the_file_blocks_draft_for_the_float32_model_losslessly_and_mostly_accepted(smollm2, plain_outputs_float):
    """Zhang & Li's quantized self-drafter: the float32 model (the file's blocks dequantized) drafted for
    by its own GGUF blocks on the integer dot products. Lossless, and since the two differ only by the
    activations' 8-bit rounding, most drafts are accepted (~0.95 on the suite)."""
    from fastdecode.drafters.factory import DrafterOptions

    model, tokenizer = smollm2
    drafter = DrafterOptions(name="draft-model", k=4, draft_quant="gguf").build(model, tokenizer)
    assert drafter.executor.weights == "gguf:q4_1+q8_0"
    engine = Engine(model, tokenizer, drafter=drafter)
    drafted = accepted = 0
    for prompt, plain in plain_outputs_float.items():
        result = engine.generate(prompt, max_new_tokens=32, draft_k=4)
        assert result.token_ids == plain.token_ids, prompt[:40]
        drafted += result.acceptance.drafted_tokens
        accepted += result.acceptance.accepted_tokens
    assert drafted > 0 and accepted / drafted > 0.7
