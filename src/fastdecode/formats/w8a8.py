"""The ``w8a8`` weight format: int8 weights with one float32 scale per output channel (symmetric,
round-to-nearest), each row of activations quantized to int8 with one scale per token (dynamic),
integer dot products summed exactly in int32 over the whole input, times ``dw[n] * dx[m]``
(``fastdecode.kernels.w8a8``; the C in ``kernels/w8a8.c``). Row-invariant on every path
(AVX-512 VNNI, AVX-VNNI, AVX2, scalar, and the torch reference), so speculative decoding is
lossless against it.

``--weights w8a8`` rounds the float weights on the fly (the LM head too);
``compress --method w8a8`` saves them as :class:`~fastdecode.quant.linear.W8A8Linear` modules,
which compute the same bits; SmoothQuant's output (``compress --method smoothquant``) and
compressed-tensors W8A8 checkpoints with per-channel weights and per-token dynamic activations
load onto these layers too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdecode.errors import ConfigError
from fastdecode.formats.base import SavedLayer, WeightFormat, refuse_group_size, refuse_settings
from fastdecode.formats.gguf import PackedNativeLinear, block_kernel
from fastdecode.kernels.quant import Projection
from fastdecode.kernels.w8a8 import pack_w8a8, w8a8_bytes, w8a8_linear_reference
from fastdecode.quant.handlers import register_quant_method, set_module
from fastdecode.quant.linear import W8A8Linear
from fastdecode.quant.math import quantize_int8_per_channel

# ---------------------------------------------------------------- native decoder


class W8A8NativeLinear(PackedNativeLinear):
    """W8A8 weights (q int8 [out, in], scales float32 [out]) on the native decoder: the C kernels
    (``kernel="qdot"``) or their torch reference (``"torch"``), the same bits. Row-invariant."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernel: str = "qdot") -> None:
        self.out_features, self.in_features = q.shape
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.kernel = kernel
        self.projection = self.q = self.scales = None
        if kernel == "qdot":
            self.projection = Projection([pack_w8a8(q, scales)], self.bias, self.in_features)
        elif kernel == "torch":
            self.q, self.scales = q.contiguous(), scales.to(torch.float32).contiguous()
        else:
            raise ConfigError(f"unknown w8a8 kernel {kernel!r}")

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return w8a8_linear_reference(x, self.q, self.scales, self.bias)

    def data_bytes(self) -> int:
        return w8a8_bytes(self.out_features, self.in_features)


def w8a8_native_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str) -> W8A8NativeLinear:
    """One weight rounded to int8 per output channel (float32 scales): the C kernels where they run
    (unless ``float_kernel="torch"``), else their torch reference."""
    q, scales = quantize_int8_per_channel(weight, float32_scales=True)
    return W8A8NativeLinear(q, scales, bias, block_kernel(float_kernel))


def _saved_w8a8_native(modules: Sequence[W8A8Linear], bias: torch.Tensor | None, float_kernel: str) -> W8A8NativeLinear:
    """Saved W8A8 modules reading one input, stacked by output into one layer (the same bits each)."""
    q = torch.cat([m.qweight for m in modules])
    scales = torch.cat([m.scales for m in modules])
    return W8A8NativeLinear(q, scales, bias, block_kernel(float_kernel))


# ---------------------------------------------------------------- transformers: config and handler


@dataclass(frozen=True)
class W8A8Config:
    """W8A8 round-to-nearest: int8 weights per output channel with float32 scales, activations
    int8 per token at run time (:class:`~fastdecode.quant.linear.W8A8Linear`)."""

    method = "w8a8"

    def to_dict(self) -> dict:
        return {"method": self.method}


@register_quant_method(W8A8Config)
def _quantize_w8a8(model, targets, config, tokenizer) -> None:
    for name, linear in targets.items():
        set_module(model, name, W8A8Linear.from_float(linear))


def _w8a8_config(group_size: int | None = None, **settings) -> W8A8Config:
    refuse_group_size("w8a8", group_size, "is per output channel")
    refuse_settings("w8a8", settings)
    return W8A8Config()


# ---------------------------------------------------------------- the entry

W8A8_LAYER = SavedLayer(
    "w8a8",
    W8A8Linear,
    layout=lambda m: {"kind": "w8a8", "shape": [m.out_features, m.in_features]},
    precision=lambda m: "w8a8",
    native=_saved_w8a8_native,
)

W8A8 = WeightFormat(
    name="w8a8",
    help="W8A8: int8 per output channel (float32 scales) x int8 activations per token, integer dot "
    "products summed exactly over the whole row (native backend)",
    native_linear=w8a8_native_linear,
    quant_config=_w8a8_config,
    saved=W8A8_LAYER,
    native_only=True,
)
