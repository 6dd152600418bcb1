"""w8a8 (fastdecode.formats.w8a8): int8 per-channel weights x int8 per-token activations on the
native decoder, the saved module computing the same bits, a compressed directory loading onto it,
and speculation against it token-identical to plain decoding."""

import copy
import json

import pytest
import torch
from speculation_checks import PROMPT, assert_speculation_is_lossless, plain_generation
from torch import nn

from fastdecode.backends import make_target
from fastdecode.backends.base import PagedSequence
from fastdecode.errors import ConfigError
from fastdecode.formats import compress_method_names, weight_format, weight_format_names
from fastdecode.formats.w8a8 import W8A8NativeLinear
from fastdecode.kernels.w8a8 import w8a8_linear_reference
from fastdecode.quant.api import config_from_method, quantize_, quantized_layers
from fastdecode.quant.linear import W8A8Linear
from fastdecode.quant.math import quantize_int8_per_channel
from fastdecode.quant.serialization import QUANT_JSON, load_quantized, save_quantized


def test_the_format_is_offered_by_name():
    assert "w8a8" in weight_format_names() and "w8a8" in compress_method_names()
    with pytest.raises(ConfigError, match="per output channel"):
        config_from_method("w8a8", group_size=32)


def test_weights_round_to_nearest_against_float32_row_scales():
    w = torch.tensor([[0.5, -1.27, 0.0, 0.254], [0.0, 0.0, 0.0, 0.0]])
    q, scales = quantize_int8_per_channel(w, float32_scales=True)
    assert scales.dtype == torch.float32 and float(scales[0]) == pytest.approx(0.01)
    assert q[0].tolist() == [50, -127, 0, 25] and q[1].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("float_kernel", ["auto", "torch"])
def test_one_weight_runs_as_the_reference(float_kernel):
    linear = nn.Linear(70, 24)  # 70 inputs: padded to 96 in the kernel's layout
    layer = weight_format("w8a8").native_linear(linear.weight, linear.bias, float_kernel)
    assert isinstance(layer, W8A8NativeLinear) and layer.row_invariant
    q, scales = quantize_int8_per_channel(linear.weight, float32_scales=True)
    x = torch.randn(9, 70)
    assert torch.equal(layer(x), w8a8_linear_reference(x, q, scales, linear.bias))
    module = W8A8Linear.from_float(linear)
    assert torch.equal(module(x), layer(x))  # the saved module: the same bits
    assert module(x.to(torch.bfloat16)).dtype == torch.bfloat16


def _prompt_logits(model, weights="float"):
    return PagedSequence(make_target(model, "native", weights)).forward(PROMPT, len(PROMPT))


def test_w8a8_runs_the_whole_model_close_to_float(tiny_model):
    target = make_target(tiny_model, "native", "w8a8")
    assert target.weights == "w8a8" and target._layer_calls is not None  # one C call a pass
    logits, reference = _prompt_logits(tiny_model, "w8a8"), _prompt_logits(tiny_model)
    assert float((logits - reference).norm() / reference.norm()) < 0.02


def test_a_saved_directory_loads_to_the_same_bits_as_weights_w8a8(tiny_model, tmp_path):
    model = copy.deepcopy(tiny_model)
    config = config_from_method("w8a8")
    quantize_(model, config, skip=())  # the LM head too, as --weights w8a8 does
    assert {layer["kind"] for layer in quantized_layers(model).values()} == {"w8a8"}
    save_quantized(model, None, tmp_path, config)
    assert json.loads((tmp_path / QUANT_JSON).read_text())["layers"]["lm_head"]["kind"] == "w8a8"
    loaded, _ = load_quantized(tmp_path)
    assert make_target(loaded, "native").weights == "w8a8"
    assert torch.equal(_prompt_logits(loaded), _prompt_logits(tiny_model, "w8a8"))
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_wrongly_typed_saved_tensor_is_refused():
    module = W8A8Linear(64, 8, bias=False)
    with pytest.raises(RuntimeError, match="expected torch.int8"):
        module.load_state_dict({"qweight": torch.zeros(8, 64), "scales": torch.ones(8)})
    with pytest.raises(ConfigError, match="int8"):
        W8A8Linear.from_quantized(torch.zeros(8, 64), torch.ones(8))


def test_non_finite_saved_scales_are_refused():
    module = W8A8Linear(64, 8, bias=False)
    scales = torch.ones(8)
    scales[3] = float("nan")
    with pytest.raises(RuntimeError, match="scales must be finite"):
        module.load_state_dict({"qweight": torch.zeros(8, 64, dtype=torch.int8), "scales": scales})


@pytest.fixture(scope="module")
def plain_w8a8(tiny_model, tokenizer):
    return plain_generation(tiny_model, tokenizer, "w8a8")


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_against_w8a8_is_token_identical_to_plain(tiny_model, tokenizer, plain_w8a8, drafter):
    assert_speculation_is_lossless(tiny_model, tokenizer, "w8a8", plain_w8a8, drafter)
