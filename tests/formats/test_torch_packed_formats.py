"""int8, int4, int4-gptq (``fastdecode.formats.torch_packed``): torch's packed modules for the
transformers path and ``fastdecode quantize``, and the native decoder's layers over the same values."""

import pytest
import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats import saved_layer_of, saved_layers, weight_format
from fastdecode.formats.torch_packed import Int4WeightOnlyConfig, Int8WeightOnlyConfig, RowInvariantInt8Linear
from fastdecode.kernels.cpu import rowgemm_unavailable
from fastdecode.quant.gptq import GPTQConfig
from fastdecode.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear


def _weights(out_features=48, in_features=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen), torch.randn(out_features, generator=gen)


def _linear(weight, bias):
    linear = nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


@pytest.mark.parametrize(
    "name, config",
    [
        ("int8", Int8WeightOnlyConfig()),
        ("int4", Int4WeightOnlyConfig(32)),
        ("int4-gptq", GPTQConfig(bits=4)),
        ("int8-gptq", GPTQConfig(bits=8, group_size=None)),
    ],
)
def test_each_entry_builds_its_config(name, config):
    assert weight_format(name).quant_config() == config


def test_group_sizes_and_settings_go_where_they_apply():
    assert weight_format("int4").quant_config(64) == Int4WeightOnlyConfig(64)
    assert weight_format("int4-gptq").quant_config(64, num_samples=2) == GPTQConfig(
        bits=4, group_size=64, num_samples=2
    )
    with pytest.raises(ConfigError, match=r"^int8 is per-channel and takes no group size \(got 32\)$"):
        weight_format("int8").quant_config(32)
    with pytest.raises(ConfigError, match=r"^int8-gptq is per-channel and takes no group size"):
        weight_format("int8-gptq").quant_config(32)
    with pytest.raises(ConfigError, match=r"^int4 takes no settings beyond group_size \(got \['seq_len'\]\)$"):
        weight_format("int4").quant_config(seq_len=4)


def test_the_gptq_entries_save_as_the_rtn_layouts_and_run_only_as_saved_models():
    assert weight_format("int4-gptq").saved is weight_format("int4").saved is saved_layers()["int4"]
    assert weight_format("int8-gptq").saved is weight_format("int8").saved is saved_layers()["int8"]
    assert not weight_format("int4-gptq").runs_as_weights and not weight_format("int8-gptq").listed


def test_saved_layer_records():
    w, b = _weights()
    int4 = Int4WeightOnlyLinear.from_float(_linear(w, b), 64)
    int8 = Int8WeightOnlyLinear.from_float(_linear(w, b))
    assert saved_layer_of(int4).layout(int4) == {"kind": "int4", "group_size": 64}
    assert saved_layer_of(int8).layout(int8) == {"kind": "int8"}
    assert (saved_layer_of(int4).precision(int4), saved_layer_of(int8).precision(int8)) == ("int4", "int8")
    assert saved_layer_of(nn.Linear(4, 4)) is None


def test_int4_native_is_torchs_packed_module_of_the_same_weights():
    w, b = _weights()
    x = torch.randn(3, 64)
    for float_kernel in ("auto", "torch"):
        layer = weight_format("int4").native_linear(w, b, float_kernel)
        assert type(layer) is Int4WeightOnlyLinear
        assert torch.equal(layer(x), Int4WeightOnlyLinear.from_float(_linear(w, b))(x))


def test_int8_native_on_torch_is_the_transformers_module():
    w, b = _weights()
    x = torch.randn(3, 64)
    layer = weight_format("int8").native_linear(w, b, "torch")
    assert type(layer) is Int8WeightOnlyLinear
    assert torch.equal(layer(x), Int8WeightOnlyLinear.from_float(_linear(w, b))(x))


@pytest.mark.skipif(rowgemm_unavailable() is not None, reason=str(rowgemm_unavailable()))
def test_int8_native_takes_the_row_invariant_kernel_over_the_same_values():
    w, b = _weights()
    layer = weight_format("int8").native_linear(w, b, "auto")
    module = Int8WeightOnlyLinear.from_float(_linear(w, b))
    assert type(layer) is RowInvariantInt8Linear and layer.kernel == "rowgemm"
    assert torch.equal(layer.qweight, module.qweight)
    assert torch.equal(layer.scales, module.scales.float())
