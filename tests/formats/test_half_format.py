"""bf16 (fastdecode.formats.half): weights kept 16-bit on the row-invariant float GEMM, widened in
registers - the float32 GEMM's bits over the widened weights - and speculation against it
token-identical to plain decoding."""

import copy

import pytest
import torch
from speculation_checks import PROMPT, assert_speculation_is_lossless, plain_generation
from torch import nn

from fastdecode.backends import make_target
from fastdecode.backends.base import PagedSequence
from fastdecode.errors import ConfigError
from fastdecode.formats import weight_format, weight_format_names
from fastdecode.formats.float import FloatLinear, make_float_linear
from fastdecode.formats.half import HalfLinear
from fastdecode.kernels.cpu import rowgemm_unavailable

needs_c = pytest.mark.skipif(rowgemm_unavailable() is not None, reason=str(rowgemm_unavailable()))


@pytest.fixture(scope="module")
def bf16_model(tiny_model):
    """The tiny model with every weight rounded to bfloat16 (a bf16 checkpoint, held in float32)."""
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def test_the_format_is_offered_by_name_on_the_native_backend(tiny_model):
    assert "bf16" in weight_format_names()
    with pytest.raises(ConfigError, match="native backend only"):
        make_target(tiny_model, "hf", "bf16")


@needs_c
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_weight_gives_the_float32_gemms_bits_over_its_widened_values(dtype):
    linear = nn.Linear(70, 21)  # 70 inputs: a tail past the vectors of 8; 21 outputs: past the blocks of 8
    w16 = linear.weight.detach().to(dtype)
    layer = HalfLinear(w16, linear.bias)
    assert layer.row_invariant and layer.data_bytes() == 21 * 70 * 2
    float32 = make_float_linear(w16.to(torch.float32), linear.bias, "rowgemm")
    x = torch.randn(9, 70)
    full = layer(x)
    assert torch.equal(full, float32(x))
    for m in range(1, 10):
        assert torch.equal(layer(x[m - 1 : m]), full[m - 1 : m]), m
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        HalfLinear(linear.weight, None)


def test_the_entry_rounds_to_bf16_and_falls_back_to_the_float_path():
    linear = nn.Linear(64, 16)
    fallback = weight_format("bf16").native_linear(linear.weight, linear.bias, "torch")
    assert isinstance(fallback, FloatLinear) and torch.equal(fallback.weight, linear.weight.to(torch.bfloat16).float())
    if rowgemm_unavailable() is None:
        layer = weight_format("bf16").native_linear(linear.weight, linear.bias, "auto")
        assert isinstance(layer, HalfLinear) and layer.weight.dtype == torch.bfloat16


@needs_c
def test_a_bf16_checkpoint_runs_bit_for_bit_as_its_float32_weights(bf16_model):
    target = make_target(bf16_model, "native", "bf16")
    assert target.weights == "bf16" and target.float_kernel == "rowgemm"
    assert isinstance(target.lm_head, HalfLinear) and target._layer_calls is not None  # one C call a pass
    sequence = PagedSequence(target)
    logits = sequence.forward(PROMPT, len(PROMPT))
    assert torch.equal(logits, PagedSequence(make_target(bf16_model, "native", "float")).forward(PROMPT, len(PROMPT)))
    sequence.reset()
    assert torch.equal(torch.cat([sequence.forward([t], 1) for t in PROMPT]), logits)  # each row its own bits


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_is_token_identical_to_plain(bf16_model, tokenizer, drafter):
    plain = plain_generation(bf16_model, tokenizer, "bf16")
    assert_speculation_is_lossless(bf16_model, tokenizer, "bf16", plain, drafter)
