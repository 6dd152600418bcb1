"""Linear layers for the native decoder, by weight precision: a view of the weight-format
registry (``fastdecode.formats``), where each format's native layer is defined.

``float``: the model's own weight in the model's dtype, on fastdecode's
row-invariant GEMM in float32 on a CPU (``fastdecode.formats.float``). ``int8``,
``int4``: ``fastdecode.formats.torch_packed``. ``q8_0``, ``q4_0``, ``q4_1``, ``gguf``:
GGUF's block formats on integer dot products (``fastdecode.formats.gguf``).
"""

from __future__ import annotations

from fastdecode.formats import (
    FLOAT_KERNELS,
    block_precision_names,
    linear_weight_bytes,
    make_linear,
    weight_format_names,
)
from fastdecode.formats.float import FloatLinear, RowInvariantLinear, float_kernel_unavailable, make_float_linear
from fastdecode.formats.gguf import BlockLinear, BlockWeights, block_kernel
from fastdecode.formats.torch_packed import RowInvariantInt8Linear

BLOCK_PRECISIONS = block_precision_names()  # "q8_0", "q4_0", "q4_1", "gguf"
WEIGHT_PRECISIONS = weight_format_names()  # "float", "int8", "int4", *BLOCK_PRECISIONS

__all__ = [
    "BLOCK_PRECISIONS",
    "FLOAT_KERNELS",
    "WEIGHT_PRECISIONS",
    "BlockLinear",
    "BlockWeights",
    "FloatLinear",
    "RowInvariantInt8Linear",
    "RowInvariantLinear",
    "block_kernel",
    "float_kernel_unavailable",
    "linear_weight_bytes",
    "make_float_linear",
    "make_linear",
]
