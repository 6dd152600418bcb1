"""Weight-only quantization (int8 per-channel, int4 group-wise, RTN and GPTQ; GGUF's
block formats q8_0, q4_0, q4_1 with ggml's rounding).

    from fastdecode.quant import quantize_, Int4WeightOnlyConfig
    quantize_(model, Int4WeightOnlyConfig(group_size=32))

``math`` holds the pure quantization math, ``linear`` the kernel-backed layers,
``handlers`` the handler registry, ``gptq`` the GPTQ method, ``api`` ``quantize_`` and
the configs (each defined with its weight format, ``fastdecode.formats``),
``serialization`` the on-disk format.

The public names are imported on first use (PEP 562): the weight formats build on
``math``, ``linear`` and ``handlers``, and ``api`` on the formats, so importing one of
those modules must not import ``api`` through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        (
            "quantize_",
            "Int8WeightOnlyConfig",
            "Int4WeightOnlyConfig",
            "GPTQConfig",
            "GGUFBlockConfig",
            "AWQConfig",
            "SmoothQuantConfig",
            "config_from_method",
            "register_quant_method",
            "default_calibration_text",
            "model_weight_bytes",
            "quantized_layers",
        ),
        "fastdecode.quant.api",
    ),
    **dict.fromkeys(("Int8WeightOnlyLinear", "Int4WeightOnlyLinear", "GGUFBlockLinear"), "fastdecode.quant.linear"),
    **dict.fromkeys(("save_quantized", "load_quantized", "is_quantized_dir"), "fastdecode.quant.serialization"),
}
__all__ = [
    "quantize_",
    "Int8WeightOnlyConfig",
    "Int4WeightOnlyConfig",
    "GPTQConfig",
    "GGUFBlockConfig",
    "AWQConfig",
    "SmoothQuantConfig",
    "config_from_method",
    "register_quant_method",
    "default_calibration_text",
    "model_weight_bytes",
    "quantized_layers",
    "Int8WeightOnlyLinear",
    "Int4WeightOnlyLinear",
    "GGUFBlockLinear",
    "save_quantized",
    "load_quantized",
    "is_quantized_dir",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdecode.quant' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs: the names as they are
    from fastdecode.quant.api import (
        GGUFBlockConfig,
        GPTQConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        config_from_method,
        default_calibration_text,
        model_weight_bytes,
        quantize_,
        quantized_layers,
        register_quant_method,
    )
    from fastdecode.quant.linear import GGUFBlockLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear
    from fastdecode.quant.serialization import is_quantized_dir, load_quantized, save_quantized
