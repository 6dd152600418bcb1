"""Linear layers for the native decoder, by weight precision.

``float``: the model's own weight in the model's dtype, multiplied with
``F.linear``. ``int8`` / ``int4``: fastdecode's weight-only quantized layers
(``fastdecode.quant``), which run on torch's packed low-bit CPU kernels.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fastdecode.errors import ConfigError

WEIGHT_PRECISIONS = ("float", "int8", "int4")


class FloatLinear:
    """``F.linear`` over the model's own weight tensor (no copy)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()  # [out_features, in_features]
        self.bias = None if bias is None else bias.detach()
        self.out_features = self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


def linear_weight_bytes(layer) -> int:
    """Bytes one call of ``layer`` reads for its weights (0 if unknown)."""
    if hasattr(layer, "weight_bytes"):
        return layer.weight_bytes()
    if isinstance(layer, torch.nn.Linear):
        return sum(p.numel() * p.element_size() for p in layer.parameters())
    return sum(linear_weight_bytes(m) for m in getattr(layer, "parts", ()))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """weight: [out_features, in_features]."""
    if precision == "float":
        return FloatLinear(weight, bias)
    if precision in ("int8", "int4"):
        from fastdecode.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        if precision == "int8":
            return Int8WeightOnlyLinear.from_float(layer)
        return Int4WeightOnlyLinear.from_float(layer)
    raise ConfigError(f"unknown weight precision {precision!r}; choose one of {', '.join(WEIGHT_PRECISIONS)}")
