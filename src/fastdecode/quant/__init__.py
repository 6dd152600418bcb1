"""Weight-only quantization (int8 per-channel, int4 group-wise, RTN and GPTQ; GGUF's
block formats q8_0, q4_0, q4_1 with ggml's rounding).

    from fastdecode.quant import quantize_, Int4WeightOnlyConfig
    quantize_(model, Int4WeightOnlyConfig(group_size=32))

``math`` holds the pure quantization math, ``linear`` the kernel-backed layers,
``api`` the configs and the handler registry, ``serialization`` the on-disk format.
"""

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

__all__ = [
    "quantize_",
    "Int8WeightOnlyConfig",
    "Int4WeightOnlyConfig",
    "GPTQConfig",
    "GGUFBlockConfig",
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
