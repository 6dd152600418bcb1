"""q8_0, q4_0, q4_1, gguf (``fastdecode.formats.gguf``): the native decoder's block layers,
built from one weight, from a model, or from saved block modules, compute the same bits."""

import pytest
import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats import saved_layer_of, weight_format
from fastdecode.formats.gguf import BlockLinear, BlockWeights, GGUFBlockConfig
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.quant.linear import GGUFBlockLinear

BLOCK_FORMATS = ["q8_0", "q4_0", "q4_1"]


def _linear(out_features, in_features=80, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_one_weight_a_saved_module_and_the_transformers_module_agree(fmt):
    entry = weight_format(fmt)
    linear = _linear(24)
    x = torch.randn(5, 80)
    layer = entry.native_linear(linear.weight, linear.bias, "torch")
    module = GGUFBlockLinear.from_float(linear, fmt)
    assert type(layer) is BlockLinear and layer.kernel == "torch"
    assert torch.equal(layer(x), module(x))
    saved = saved_layer_of(module)
    assert saved is entry.saved and saved.layout(module) == {"kind": "gguf_block", "format": fmt, "shape": [24, 80]}
    assert saved.precision(module) == fmt
    assert torch.equal(saved.native([module], linear.bias.detach(), "torch")(x), layer(x))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_stacked_modules_compute_what_their_fused_weight_does(fmt):
    parts = [_linear(16, seed=1), _linear(8, seed=2)]
    weight = torch.cat([p.weight for p in parts]).detach()
    bias = torch.cat([p.bias for p in parts]).detach()
    x = torch.randn(3, 80)
    fused = weight_format(fmt).native_linear(weight, bias, "torch")
    modules = [GGUFBlockLinear.from_float(p, fmt) for p in parts]
    assert torch.equal(weight_format(fmt).saved.native(modules, bias, "torch")(x), fused(x))


def test_native_layers_build_from_each_module_and_name_the_numeric_model():
    from tiny_models import tiny_llama

    model = tiny_llama()
    layers = weight_format("q4_1").native_layers(model, "torch")
    assert isinstance(layers, BlockWeights)
    attn = model.model.layers[0].self_attn
    layer = layers([attn.q_proj, attn.k_proj, attn.v_proj], None)
    assert (
        layer.formats == ["q4_1"] and layers.counts == {"q4_1": 3} and layers.weights == "q4_1" and layers.note is None
    )
    gguf = weight_format("gguf").native_layers(model, "torch")
    gguf([attn.o_proj], None)
    assert gguf.weights == "gguf:q8_0" and "not loaded from a GGUF file" in gguf.note


def test_gguf_needs_the_model_and_block_configs_take_no_group_size():
    with pytest.raises(ConfigError, match="--weights gguf takes the model's own GGUF blocks"):
        weight_format("gguf").native_linear(torch.zeros(8, 32), None, "auto")
    assert weight_format("gguf").quant_config is None and weight_format("gguf").native_only
    assert weight_format("q4_0").quant_config() == GGUFBlockConfig("q4_0")
    with pytest.raises(ConfigError, match=r"^q4_0 quantizes in fixed blocks of 32 weights and takes no group size"):
        weight_format("q4_0").quant_config(32)
    with pytest.raises(ConfigError, match="unknown GGUF block format 'q5_k'"):
        GGUFBlockConfig("q5_k")


def test_block_tensors_round_trip_through_the_saved_module():
    linear = _linear(16)
    module = GGUFBlockLinear.from_float(linear, "q8_0")
    assert (module.block_tensor().blocks == BlockTensor.quantize(linear.weight, "q8_0").blocks).all()
