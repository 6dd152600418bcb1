"""Linear layers for the native decoder, by weight precision: a view of the weight-format
registry (``fastdecode.formats``), where each format's native layer is defined.

``float``: the model's own weight in the model's dtype, on fastdecode's
row-invariant GEMM in float32 on a CPU (``fastdecode.formats.float``). ``int8``,
``int4``: ``fastdecode.formats.torch_packed``. ``q8_0``, ``q4_0``, ``q4_1``, ``gguf``:
GGUF's block formats on integer dot products (``fastdecode.formats.gguf``).
"""

from __future__ import annotations

import torch

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
    "probe_row_group",
]


def probe_row_group(layers, rows: int, device, dtype) -> tuple[int, int]:
    """The widest [a, b] with 1 <= a <= b <= ``rows`` such that each of ``layers`` ((linear,
    in_features) pairs) gives every row of an m-row call (a <= m <= b) the bits it gets in the
    (m - 1)-row call (``NativeTarget``'s row groups)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    outs = []
    for layer, in_features in layers:
        x = torch.randn(rows, in_features, generator=gen).to(device=device, dtype=dtype)
        outs.append({m: layer(x[:m]) for m in range(1, rows + 1)})

    def extends(m: int) -> bool:  # the m-row call agrees with the (m - 1)-row call on all m - 1 rows
        return all(torch.equal(o[m][: m - 1], o[m - 1]) for o in outs)

    best = (1, 1)
    for a in range(1, rows + 1):
        b = a
        while b < rows and extends(b + 1):
            b += 1
        if b - a > best[1] - best[0]:
            best = (a, b)
    return best
