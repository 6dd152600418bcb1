import numpy as np
import pytest
import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.quant import math as qmath
from fastdecode.quant.linear import GGUFBlockLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear

LAYOUTS = [
    pytest.param(lambda lin: Int8WeightOnlyLinear.from_float(lin), id="int8"),
    pytest.param(lambda lin: Int4WeightOnlyLinear.from_float(lin, 32), id="int4-g32"),
    pytest.param(lambda lin: Int4WeightOnlyLinear.from_float(lin, 64), id="int4-g64"),
    pytest.param(lambda lin: Int4WeightOnlyLinear.from_float(lin, 128), id="int4-g128"),
]


def _linear(in_features=256, out_features=96, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _rel(a, b):
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()


@pytest.mark.parametrize("make", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_dequantized_reference(make, bias):
    linear = _linear(bias=bias)
    layer = make(linear)
    x = torch.randn(2, 3, 256)  # any leading shape
    y = layer(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32
    reference = x @ layer.dequantize().T + (linear.bias if bias else 0)
    # The kernels compute in bfloat16: ~3e-3 relative.
    assert _rel(y, reference) < 1e-2


@pytest.mark.parametrize("make", LAYOUTS)
def test_bfloat16_activations_give_bfloat16_outputs(make):
    layer = make(_linear())
    x = torch.randn(5, 256)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert _rel(y, layer(x)) < 1e-2


def test_int8_close_to_float():
    linear = _linear()
    x = torch.randn(8, 256)
    assert _rel(Int8WeightOnlyLinear.from_float(linear)(x), linear(x)) < 1e-2


def test_int4_close_to_float():
    linear = _linear()
    x = torch.randn(8, 256)
    assert _rel(Int4WeightOnlyLinear.from_float(linear, 32)(x), linear(x)) < 0.1


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_from_quantized_keeps_the_exact_values(group_size):
    w = torch.randn(64, 256)
    q, scales, zeros = qmath.quantize_int4_groupwise(w, group_size)
    layer = Int4WeightOnlyLinear.from_quantized(q, scales, zeros, group_size)
    assert torch.equal(layer.unpacked(), q)
    torch.testing.assert_close(
        layer.dequantize(), qmath.dequantize_int4_groupwise(q, scales, zeros, group_size), rtol=0, atol=0
    )


def test_int8_from_quantized_keeps_the_exact_values():
    q, scales = qmath.quantize_int8_per_channel(torch.randn(64, 256))
    layer = Int8WeightOnlyLinear.from_quantized(q, scales)
    assert torch.equal(layer.qweight, q)
    torch.testing.assert_close(layer.dequantize(), qmath.dequantize_int8_per_channel(q, scales), rtol=0, atol=0)


@pytest.mark.parametrize(
    "make, min_ratio",
    [
        (lambda lin: Int8WeightOnlyLinear.from_float(lin), 3.9),  # 1 B/weight + 2 B/row
        (lambda lin: Int4WeightOnlyLinear.from_float(lin, 32), 6.3),  # 0.5 B + 4 B/32 weights
        (lambda lin: Int4WeightOnlyLinear.from_float(lin, 128), 7.4),
    ],
)
def test_weight_bytes_shrink(make, min_ratio):
    linear = _linear(512, 256, bias=False)
    layer = make(linear)
    float_bytes = linear.weight.numel() * 4
    assert float_bytes / layer.weight_bytes() > min_ratio


def test_int4_state_dict_is_portable_and_reloads_identically():
    layer = Int4WeightOnlyLinear.from_float(_linear(), 64)
    state = layer.state_dict()
    # The CPU-specific kernel layout is never saved.
    assert set(state) == {"qweight", "scales_and_zeros", "bias"}
    assert state["qweight"].dtype == torch.uint8 and state["qweight"].shape == (96, 128)
    low, high = state["qweight"] & 0x0F, state["qweight"] >> 4
    q = layer.unpacked()
    assert torch.equal(low, q[:, 0::2]) and torch.equal(high, q[:, 1::2])

    fresh = Int4WeightOnlyLinear(256, 96, bias=True, group_size=64)
    fresh.load_state_dict(state)
    x = torch.randn(4, 256)
    assert torch.equal(fresh(x), layer(x))


def test_int4_load_rejects_wrong_qweight_shape():
    layer = Int4WeightOnlyLinear(256, 96, group_size=64)
    state = layer.state_dict()
    state["qweight"] = torch.zeros(96, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="qweight"):
        layer.load_state_dict(state)


@pytest.mark.parametrize(
    "in_features, out_features, group_size, match",
    [
        (96, 64, 64, "does not divide"),
        (256, 40, 32, "out_features"),
        (256, 64, 16, "group size"),
    ],
)
def test_int4_rejects_shapes_the_kernel_cannot_run(in_features, out_features, group_size, match):
    with pytest.raises(ConfigError, match=match):
        Int4WeightOnlyLinear.from_float(nn.Linear(in_features, out_features), group_size)


def test_int8_rejects_in_features_the_kernel_cannot_run():
    # torch's int8 kernel silently miscomputes (or crashes) when in_features % 16 != 0.
    with pytest.raises(ConfigError, match="in_features"):
        Int8WeightOnlyLinear.from_float(nn.Linear(40, 64))


# -- GGUF block formats ------------------------------------------------------

BLOCK_FORMATS = ["q8_0", "q4_0", "q4_1"]


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("in_features", [256, 80])  # 80: a row padded to three blocks
def test_block_layer_computes_what_the_native_block_linear_computes(fmt, in_features):
    from fastdecode.backends.linear import BlockLinear
    from fastdecode.kernels.gguf_blocks import BlockTensor
    from fastdecode.kernels.quant import block_linear_reference

    linear = _linear(in_features, 96)
    layer = GGUFBlockLinear.from_float(linear, fmt)
    bt = BlockTensor.quantize(linear.weight, fmt)
    assert np.array_equal(layer.block_tensor().blocks, bt.blocks) and layer.format == fmt
    x = torch.randn(2, 5, in_features)  # any leading shape
    y = layer(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    assert torch.equal(y, block_linear_reference(x, [bt], linear.bias))
    assert torch.equal(y, BlockLinear([bt], linear.bias, "torch")(x))
    assert _rel(y, linear(x)) < (0.02 if fmt == "q8_0" else 0.2)
    assert torch.equal(layer.dequantize(), bt.dequantize())


def test_block_layer_rows_are_independent_of_the_row_count():
    layer = GGUFBlockLinear.from_float(_linear(), "q4_1")
    x = torch.randn(9, 256)
    assert torch.equal(layer(x)[3:4], layer(x[3:4]))


def test_block_layer_takes_bfloat16_and_copies():
    import copy

    layer = GGUFBlockLinear.from_float(_linear(bias=False), "q4_0")
    x = torch.randn(4, 256)
    y = layer(x)  # builds the kernels' packed copy
    assert torch.equal(layer(x.bfloat16()), layer(x.bfloat16().float()).bfloat16())
    twin = copy.deepcopy(layer)
    assert torch.equal(twin(x), y) and twin.blocks.data_ptr() != layer.blocks.data_ptr()


def test_block_layer_state_dict_is_its_raw_blocks():
    layer = GGUFBlockLinear.from_float(_linear(), "q4_0")
    state = layer.state_dict()
    assert set(state) == {"blocks", "bias"}
    assert state["blocks"].dtype == torch.uint8 and state["blocks"].shape == (96, 8 * 18)  # 8 blocks of 18 bytes
    fresh = GGUFBlockLinear(256, 96, format="q4_0")
    x = torch.randn(3, 256)
    fresh(x)  # a packed copy of the zeros, dropped by the load
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), layer(x))
    state["blocks"] = state["blocks"].float()  # a plain buffer load would cast it silently
    with pytest.raises(RuntimeError, match="uint8"):
        fresh.load_state_dict(state)


def test_block_layer_weight_bytes():
    layer = GGUFBlockLinear.from_float(_linear(512, 256, bias=False), "q4_0")
    assert layer.weight_bytes() == 256 * 16 * 18  # 4.5 bits a weight


def test_block_layer_rejects_an_unknown_format():
    with pytest.raises(ConfigError, match="q4_0"):
        GGUFBlockLinear(256, 96, format="q5_k")
    with pytest.raises(ConfigError, match="q4_0"):
        GGUFBlockLinear.from_float(_linear(), "q3")
