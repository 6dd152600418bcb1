"""The weight-format registry (``fastdecode.formats``): the names front ends offer come from
its entries, an unknown name is refused with the choices, and a new entry is one registration."""

import pytest
import torch

from fastdecode import formats
from fastdecode.backends import linear as backends_linear
from fastdecode.errors import ConfigError
from fastdecode.formats import (
    COMPRESSION_METHODS,
    WEIGHT_FORMATS,
    WeightFormat,
    compress_method_names,
    draft_quant_names,
    make_linear,
    register_format,
    weight_format,
    weight_format_names,
)
from fastdecode.formats.float import make_float_linear
from fastdecode.quant.api import QUANT_HANDLERS, config_from_method


def test_the_name_lists_the_front_ends_offer():
    assert weight_format_names() == (
        "float",
        "bf16",
        "int8",
        "int4",
        "q8_0",
        "q4_0",
        "q4_1",
        "gguf",
        "sparse24",
        "sparse24-f32",
        "w8a8",
    )
    assert compress_method_names() == (
        *("int8", "int4", "int4-gptq", "q8_0", "q4_0", "q4_1", "w8a8", "awq", "smoothquant"),
        *("magnitude", "wanda", "sparsegpt"),
    )
    assert draft_quant_names() == (
        "none",
        "bf16",
        "int8",
        "int4",
        "int4-gptq",
        "q8_0",
        "q4_0",
        "q4_1",
        "gguf",
        "sparse24",
        "sparse24-f32",
        "w8a8",
        "awq",
        "smoothquant",
    )
    assert formats.block_precision_names() == (
        *("bf16", "q8_0", "q4_0", "q4_1", "gguf"),
        *("sparse24", "sparse24-f32", "w8a8"),
    )
    assert formats.quant_method_names() == (
        "int8",
        "int4",
        "int4-gptq",
        "int8-gptq",
        "q8_0",
        "q4_0",
        "q4_1",
        "w8a8",
        "awq",
        "smoothquant",
        "magnitude",
        "wanda",
        "sparsegpt",
    )


@pytest.mark.parametrize("fmt", list(WEIGHT_FORMATS), ids=lambda f: f.name)
def test_every_registered_format_is_offered_where_it_can_serve(fmt):
    assert weight_format(fmt.name) is fmt
    offered = {
        weight_format_names: fmt.runs_as_weights,
        compress_method_names: fmt.quant_config is not None and fmt.saved is not None,  # (and the methods)
        draft_quant_names: fmt.name != "float",
    }
    for names, serves in offered.items():
        assert (fmt.name in names()) == (fmt.listed and serves), names.__name__
    assert fmt.help and "\n" not in fmt.help


def test_every_format_is_listed_somewhere_but_one_kept_by_name():
    listed = set(weight_format_names()) | set(compress_method_names()) | set(draft_quant_names())
    assert {f.name for f in WEIGHT_FORMATS} - listed == {"int8-gptq"}


def test_an_unknown_name_is_a_config_error_listing_the_choices():
    with pytest.raises(
        ConfigError, match=r"^unknown weight format 'q3'; choose from: bf16, float, gguf, int4, int4-gptq, int8"
    ):
        weight_format("q3")
    with pytest.raises(
        ConfigError,
        match=r"unknown weight precision 'q3'; choose one of float, bf16, int8, int4, q8_0, q4_0, "
        r"q4_1, gguf, sparse24, sparse24-f32, w8a8$",
    ):
        make_linear(torch.zeros(4, 4), None, "q3")
    with pytest.raises(
        ConfigError,
        match=r"unknown quantization method 'q3'; choose from int8, int4, int4-gptq, "
        r"int8-gptq, q8_0, q4_0, q4_1, w8a8, awq, smoothquant, magnitude, wanda, sparsegpt$",
    ):
        config_from_method("q3")


def test_a_name_registered_twice_is_refused():
    with pytest.raises(ValueError, match="weight format 'int8' is already registered"):
        register_format(WeightFormat("int8", "again", native_linear=make_float_linear))


def test_the_backend_views_are_the_registry():
    assert weight_format_names() == backends_linear.WEIGHT_PRECISIONS
    assert tuple(f.name for f in WEIGHT_FORMATS if f.native_only) == backends_linear.BLOCK_PRECISIONS
    assert backends_linear.make_linear is make_linear


@pytest.mark.parametrize("name", compress_method_names())
def test_each_compress_method_builds_a_config_with_a_handler(name):
    config = config_from_method(name)
    assert config.method == name and type(config) in QUANT_HANDLERS
    # a method (AWQ, SmoothQuant) is not a format: it saves its weights in one that can be saved
    fmt = COMPRESSION_METHODS.get(name).formats[0] if name in COMPRESSION_METHODS else name
    # (pruning without --then keeps float weights: saved as a plain model directory, save_float)
    assert weight_format(fmt).saved is not None or (fmt == "float" and config.format == "float")


def test_a_new_format_is_one_registration():
    def halved(weight, bias, float_kernel):
        return make_float_linear(weight / 2, bias, float_kernel)

    fmt = register_format(WeightFormat("half-test", "the weights halved (a test's format)", native_linear=halved))
    try:
        # a new format comes last among the formats, before the calibrated methods
        assert weight_format_names()[-1] == "half-test" and draft_quant_names()[-3] == "half-test"
        assert "half-test" not in compress_method_names()
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        assert torch.equal(make_linear(w, None, "half-test", "torch")(x), torch.nn.functional.linear(x, w / 2))
        assert weight_format("half-test") is fmt
    finally:
        WEIGHT_FORMATS.unregister("half-test")
    assert "half-test" not in weight_format_names()


def test_an_unknown_float_kernel_is_refused_for_every_format():
    for name in weight_format_names():
        with pytest.raises(ConfigError, match="unknown float kernel 'x'; choose one of auto, rowgemm, torch"):
            make_linear(torch.zeros(32, 32), None, name, "x")
