"""Linear layers for the native decoder, by weight precision.

``float``: the model's own weight in the model's dtype. In float32 on a CPU
the ``auto`` kernel is fastdecode's row-invariant GEMM
(``fastdecode.kernels.cpu``) for decode and verification passes, where a row
must get the same bits whatever the row count; otherwise ``F.linear``.
``int8``: the same kernel over int8 weights where it runs (float32
activations), else fastdecode's weight-only quantized layer on torch's packed
kernel. ``int4``: fastdecode's quantized layer (``fastdecode.quant``) on
torch's packed int4 kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fastdecode.errors import ConfigError

WEIGHT_PRECISIONS = ("float", "int8", "int4")
FLOAT_KERNELS = ("auto", "rowgemm", "torch")


class FloatLinear:
    """``F.linear`` over the model's own weight tensor (no copy)."""

    kernel = "torch"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.detach()  # [out_features, in_features]
        self.bias = None if bias is None else bias.detach()
        self.out_features = self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


class RowInvariantLinear(FloatLinear):
    """float32 on the CPU: fastdecode's row-invariant GEMM, for every pass.

    Prefill chunks go through it too: a batched engine must give a prompt's KV
    the same bits however the prompt is chunked and whatever shares its pass
    (and a prefix cache reuses one request's KV for another). Measured on the
    2-core Zen 3 (SmolLM2 shapes): at 256 rows it runs at ~85 GFLOP/s against
    MKL's ~105-118; at 64 rows they are even."""

    kernel = "rowgemm"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from fastdecode.kernels.cpu import rowgemm

        return rowgemm(x, self.weight, self.bias)


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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        from fastdecode.quant.math import quantize_int8_per_channel

        qweight, scales = quantize_int8_per_channel(weight.detach())
        self.qweight = qweight.contiguous()  # int8 [out_features, in_features]
        self.scales = scales.to(torch.float32).contiguous()  # [out_features]
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self.out_features = self.qweight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from fastdecode.kernels.cpu import rowgemm_i8

        return rowgemm_i8(x, self.qweight, self.scales, self.bias)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.bias) if t is not None)


def float_kernel_unavailable(weight: torch.Tensor) -> str | None:
    """None when the row-invariant kernel can multiply ``weight``, else why not."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"it multiplies float32 weights on the CPU, not {weight.dtype} on {weight.device.type}"
    if not weight.is_contiguous():
        return "it needs contiguous weights"
    from fastdecode.kernels.cpu import rowgemm_unavailable

    return rowgemm_unavailable()


def make_float_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str = "auto") -> FloatLinear:
    """``auto``: the row-invariant kernel where it can run, ``F.linear`` elsewhere;
    ``rowgemm``: that kernel or a ConfigError saying why not; ``torch``: ``F.linear``."""
    if float_kernel == "torch":
        return FloatLinear(weight, bias)
    reason = float_kernel_unavailable(weight)
    if reason is None:
        return RowInvariantLinear(weight, bias)
    if float_kernel == "rowgemm":
        raise ConfigError(f"--float-kernel rowgemm cannot run here: {reason}")
    return FloatLinear(weight, bias)


def linear_weight_bytes(layer) -> int:
    """Bytes one call of ``layer`` reads for its weights (0 if unknown)."""
    if hasattr(layer, "weight_bytes"):
        return layer.weight_bytes()
    if isinstance(layer, torch.nn.Linear):
        return sum(p.numel() * p.element_size() for p in layer.parameters())
    return sum(linear_weight_bytes(m) for m in getattr(layer, "parts", ()))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str,
                float_kernel: str = "auto") -> Callable[[torch.Tensor], torch.Tensor]:
    """weight: [out_features, in_features]. ``float_kernel`` picks fastdecode's
    row-invariant kernels (``auto``, where they run) or torch's (``torch``) for
    ``float`` and ``int8``; ``int4`` always runs torch's packed kernel."""
    if float_kernel not in FLOAT_KERNELS:
        raise ConfigError(f"unknown float kernel {float_kernel!r}; choose one of {', '.join(FLOAT_KERNELS)}")
    if precision == "float":
        return make_float_linear(weight, bias, float_kernel)
    if precision == "int8" and float_kernel != "torch" and float_kernel_unavailable(weight) is None:
        return RowInvariantInt8Linear(weight, bias)
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
