"""--weights gguf on a GGUF file whose FFN tensors are MXFP4 (gpt-oss's expert weights' type), the rest
Q8_0, written by gguf-py's own quantizer: the file loads as a skeleton, every FFN runs from the file's
MXFP4 blocks (named in the result's weights), a pass gives each row a decode step's bits, and greedy decoding with speculation is token-identical to plain."""

import pytest
import torch
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.backends import PagedSequence, make_target
from fastdecode.formats.gguf_export import export_gguf
from fastdecode.kernels.quant import kernel_unavailable
from fastdecode.loaders.gguf_model import is_lazy
from fastdecode.loading import BUILTIN_MODELS, load_model

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]
FFN = {"ffn_gate": "mxfp4", "ffn_up": "mxfp4", "ffn_down": "mxfp4"}
KERNELS = ["auto", "torch"] if kernel_unavailable() is None else ["torch"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(skeleton model, tokenizer) of a tiny Llama (the embedded tokenizer's 49,152 tokens) written with
    its FFN weights in MXFP4 (K = 64: half a unit of four blocks; 128: one) and every other 2-D weight Q8_0."""
    model = tiny_llama(
        0, vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    path = tmp_path_factory.mktemp("gguf") / "mxfp4-ffn.gguf"
    export_gguf(model, path, BUILTIN_MODELS["smollm2-135m"].locate(), "q8_0", tensor_types=FFN)
    return load_model(str(path), lazy=True)


def test_the_logits_are_near_the_float_model_the_file_dequantizes_to(loaded, tmp_path_factory):
    """The same file loaded as floats (gguf-py's dequantized values, the MXFP4 FFNs' included): the
    block kernels' logits differ only by the activations' 8-bit blocks."""
    model, tok = loaded
    float_model, _ = load_model(model.config.fastdecode_gguf_file)
    ours = PagedSequence(make_target(model, "native", "gguf", tokenizer=tok)).forward(PROMPT, len(PROMPT))
    ref = PagedSequence(make_target(float_model, "native", "float")).forward(PROMPT, len(PROMPT))
    assert (ours - ref).abs().max() < 0.02 * ref.abs().max()  # 0.007 here; MXFP4 itself moves them 0.04


def test_the_ffns_run_from_the_files_mxfp4_blocks(loaded):
    model, tok = loaded
    target = make_target(model, "native", "gguf", tokenizer=tok)
    assert is_lazy(model)  # no float model was built
    assert target.weights == "gguf:q8_0+mxfp4"  # 4 attention projections a layer and the tied head; 3 FFN
    assert target.kernel_note is None  # every tensor from the file, none re-quantized
    for layer in target.layers:
        assert layer.gate_up.formats == ["mxfp4"] and layer.down.formats == ["mxfp4"]
        assert layer.qkv.formats == ["q8_0"]


@pytest.mark.parametrize("float_kernel", KERNELS)
def test_a_pass_gives_each_row_a_decode_steps_bits(loaded, float_kernel):
    model, tok = loaded
    target = PagedSequence(make_target(model, "native", "gguf", float_kernel, tokenizer=tok))
    together = target.forward(PROMPT, len(PROMPT))
    target.reset()
    one_by_one = torch.cat([target.forward([t], 1) for t in PROMPT])
    assert torch.equal(together, one_by_one)
    assert torch.isfinite(together).all()


def test_ngram_drafting_is_token_identical_to_plain(loaded):
    model, tok = loaded
    plain = Engine(model, tok, target=make_target(model, "native", "gguf", tokenizer=tok))
    expected = plain.generate(PROMPT, max_new_tokens=32).token_ids
    engine = Engine(
        model, tok, drafter=build_drafter("ngram", n=3), target=make_target(model, "native", "gguf", tokenizer=tok)
    )
    result = engine.generate(PROMPT, max_new_tokens=32, draft_k=4)
    assert result.token_ids == expected
    assert result.acceptance.drafted_tokens > 0
