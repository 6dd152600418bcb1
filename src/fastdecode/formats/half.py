"""``bf16``: the model's weights in bfloat16, kept 16-bit on fastdecode's float GEMM.

The row-invariant float32 GEMM (``kernels/cpu.c``) reads each vector of eight bf16 (or fp16)
weights and widens it in registers, exactly: every row gets the bits the float32 GEMM gives over
the widened weight, whatever the row count, at half the bytes streamed. A checkpoint stored in
bfloat16 (most are) loses nothing: its values are bf16 already; a float32 one is rounded to the
nearest bf16 (torch's round-to-nearest-even), a numeric model of its own. :class:`HalfLinear`
also runs a GGUF file's F16 and BF16 tensors as stored (``fastdecode.kernels.quant.pack``).
Where the C kernels cannot run (or ``--float-kernel torch``) the widened weights take the float
path (``fastdecode.formats.float``).
"""

from __future__ import annotations

import torch

from fastdecode.formats.base import WeightFormat
from fastdecode.formats.float import make_float_linear
from fastdecode.formats.gguf import PackedNativeLinear
from fastdecode.kernels.abi import PackedBlocks
from fastdecode.kernels.cpu import rowgemm_unavailable
from fastdecode.kernels.quant import Projection

_KINDS = {torch.bfloat16: "bf16", torch.float16: "f16"}  # kernels.abi.WEIGHT_FORMATS' names


class HalfLinear(PackedNativeLinear):
    """16-bit float weights (bfloat16 or float16) [out_features, in_features] on the row-invariant
    float GEMM, widened in registers: the float32 GEMM's bits over the widened weight, 2 bytes a
    weight. Row-invariant. Needs the C kernels (:func:`half_native_linear` falls back without them)."""

    kernel = "rowgemm"  # the kernel family it runs (the native target reports its LM head's)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dtype not in _KINDS or weight.dim() != 2:
            raise TypeError(
                f"HalfLinear takes a 2-D bfloat16 or float16 weight, not {weight.dtype} {tuple(weight.shape)}"
            )
        self.weight = weight.detach().to("cpu").contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        packed = PackedBlocks(_KINDS[weight.dtype], self.out_features, self.in_features, self.weight.view(torch.uint8))
        self.projection = Projection([packed], self.bias, self.in_features)

    def data_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def half_native_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str):
    """``weight`` rounded to bfloat16 (exact for weights that are bf16 values already): a
    :class:`HalfLinear` where the C kernels run (unless ``float_kernel="torch"``), else the float
    path's layer over the widened weight (``rowgemm`` where the kernels cannot run: a ConfigError)."""
    w16 = weight.detach().to(device="cpu", dtype=torch.bfloat16)
    if float_kernel == "torch" or rowgemm_unavailable() is not None:
        return make_float_linear(w16.to(torch.float32), bias, float_kernel)
    return HalfLinear(w16, bias)


BF16 = WeightFormat(
    name="bf16",
    help="bfloat16 weights kept 16-bit on fastdecode's float GEMM (widened in registers: the float32 "
    "GEMM's bits over them, half the bytes; exact for a bf16 checkpoint; native backend)",
    native_linear=half_native_linear,
    native_only=True,
)
