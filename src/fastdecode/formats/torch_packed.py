"""torch's packed low-bit formats: ``int8`` (per output channel, symmetric) and ``int4``
(groups of input columns, asymmetric), round-to-nearest or GPTQ (``int4-gptq``; and
``int8-gptq``, by name only).

The transformers modules are ``fastdecode.quant.linear``'s ``Int8WeightOnlyLinear`` and
``Int4WeightOnlyLinear`` on torch's packed CPU kernels (bfloat16 activations). On the
native decoder ``int8`` runs fastdecode's row-invariant kernel over the same int8
values and scales where it can (float32 activations: :class:`RowInvariantInt8Linear`),
torch's packed kernel elsewhere; ``int4`` always runs torch's packed kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastdecode.formats.base import SavedLayer, WeightFormat, refuse_group_size, refuse_settings
from fastdecode.formats.float import float_kernel_unavailable
from fastdecode.kernels.cpu import rowgemm_i8
from fastdecode.quant.gptq import GPTQConfig
from fastdecode.quant.handlers import (
    check_int4_group_size,
    check_int8_shapes,
    int4_group_sizes,
    register_quant_method,
    set_module,
)
from fastdecode.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from fastdecode.quant.math import quantize_int8_per_channel

# ---------------------------------------------------------------- transformers: configs and handlers


@dataclass(frozen=True)
class Int8WeightOnlyConfig:
    """int8 per-output-channel symmetric weights, round-to-nearest."""

    method = "int8"

    def to_dict(self) -> dict:
        return {"method": self.method}


@dataclass(frozen=True)
class Int4WeightOnlyConfig:
    """int4 asymmetric weights in groups of ``group_size`` input columns, round-to-nearest.

    A layer whose in_features ``group_size`` does not divide gets the largest
    smaller supported group size that does, with a warning.
    """

    group_size: int = 32
    method = "int4"

    def __post_init__(self) -> None:
        check_int4_group_size(self.group_size)

    def to_dict(self) -> dict:
        return {"method": self.method, "group_size": self.group_size}


@register_quant_method(Int8WeightOnlyConfig)
def _quantize_int8_rtn(model, targets, config, tokenizer) -> None:
    check_int8_shapes(targets)
    for name, linear in targets.items():
        set_module(model, name, Int8WeightOnlyLinear.from_float(linear))


@register_quant_method(Int4WeightOnlyConfig)
def _quantize_int4_rtn(model, targets, config, tokenizer) -> None:
    group_sizes = int4_group_sizes(targets, config.group_size)
    for name, linear in targets.items():
        set_module(model, name, Int4WeightOnlyLinear.from_float(linear, group_sizes[name]))


def _int8_config(group_size: int | None = None, **settings) -> Int8WeightOnlyConfig:
    refuse_group_size("int8", group_size, "is per-channel")
    refuse_settings("int8", settings)
    return Int8WeightOnlyConfig()


def _int4_config(group_size: int | None = None, **settings) -> Int4WeightOnlyConfig:
    refuse_settings("int4", settings)
    return Int4WeightOnlyConfig(group_size=group_size or 32)


def _int4_gptq_config(group_size: int | None = None, **settings) -> GPTQConfig:
    return GPTQConfig(bits=4, group_size=group_size or 32, **settings)


def _int8_gptq_config(group_size: int | None = None, **settings) -> GPTQConfig:
    refuse_group_size("int8-gptq", group_size, "is per-channel")
    return GPTQConfig(bits=8, group_size=None, **settings)


# ---------------------------------------------------------------- native decoder


class RowInvariantInt8Linear:
    """Weight-only int8 (symmetric, per output channel: ``fastdecode.quant``'s
    quantization) on fastdecode's row-invariant kernel, with float32 activations.

    torch's packed int8 kernel (``Int8WeightOnlyLinear``) casts activations to
    bf16 and is compute-bound on CPUs without AVX-512/AMX (on a 2-core Zen 3 a
    step took 21-26 ms against 23 ms for float32 on fastdecode's kernel); this
    one streams the int8 weights once per call and reduces in the float32
    kernel's order. A different numeric model from both float32 and torch's
    int8 path (float32 activations, the same int8 values and scales).

    Every pass runs it, prefill chunks included (see RowInvariantLinear)."""

    kernel = "rowgemm"
    row_invariant = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        qweight, scales = quantize_int8_per_channel(weight.detach())
        self.qweight = qweight.contiguous()  # int8 [out_features, in_features]
        self.scales = scales.to(torch.float32).contiguous()  # [out_features]
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self.out_features = self.qweight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rowgemm_i8(x, self.qweight, self.scales, self.bias)

    def layer_projection(self):
        return self.qweight, self.scales, self.bias

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.bias) if t is not None)


def _as_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` and ``bias`` themselves (no copy, no initialization)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def int8_native_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str):
    """fastdecode's row-invariant int8 kernel where it runs (not ``float_kernel="torch"``), else torch's packed one."""
    if float_kernel != "torch" and float_kernel_unavailable(weight) is None:
        return RowInvariantInt8Linear(weight, bias)
    return Int8WeightOnlyLinear.from_float(_as_linear(weight, bias))


def int4_native_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str) -> Int4WeightOnlyLinear:
    """torch's packed int4 kernel, whatever ``float_kernel`` says (group size 32)."""
    return Int4WeightOnlyLinear.from_float(_as_linear(weight, bias))


# ---------------------------------------------------------------- the entries

INT8_LAYER = SavedLayer("int8", Int8WeightOnlyLinear, layout=lambda m: {"kind": "int8"}, precision=lambda m: "int8")
INT4_LAYER = SavedLayer(
    "int4",
    Int4WeightOnlyLinear,
    layout=lambda m: {"kind": "int4", "group_size": m.group_size},
    precision=lambda m: "int4",
)

INT8 = WeightFormat(
    name="int8",
    help="int8 per output channel, round-to-nearest (native: fastdecode's row-invariant kernel, float32 activations)",
    native_linear=int8_native_linear,
    quant_config=_int8_config,
    saved=INT8_LAYER,
)
INT4 = WeightFormat(
    name="int4",
    help="int4 in groups of 32 input columns (--group-size), round-to-nearest, on torch's packed kernel",
    native_linear=int4_native_linear,
    quant_config=_int4_config,
    saved=INT4_LAYER,
)
INT4_GPTQ = WeightFormat(
    name="int4-gptq",
    help="int4 as above, rounded by GPTQ on calibration text (a saved model or a draft model, not --weights)",
    quant_config=_int4_gptq_config,
    saved=INT4_LAYER,
)
INT8_GPTQ = WeightFormat(
    name="int8-gptq",
    help="int8 per output channel, rounded by GPTQ (by name only: config_from_method)",
    quant_config=_int8_gptq_config,
    saved=INT8_LAYER,
    listed=False,
)
