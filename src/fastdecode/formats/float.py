"""``float``: the model's own weights in the model's dtype.

In float32 on a CPU the native decoder's ``auto`` kernel is fastdecode's
row-invariant GEMM (``fastdecode.kernels.cpu``) for decode and verification
passes, where a row must get the same bits whatever the row count; otherwise
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdecode.errors import ConfigError
from fastdecode.formats.base import WeightFormat
from fastdecode.kernels.cpu import rowgemm, rowgemm_unavailable


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
    row_invariant = True  # a row's bits do not depend on the row count

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rowgemm(x, self.weight, self.bias)

    def layer_projection(self):
        """The projection as fastdecode.kernels.cpu.DecoderLayerKernel takes it."""
        return self.weight, None, self.bias


def float_kernel_unavailable(weight: torch.Tensor) -> str | None:
    """None when the row-invariant kernel can multiply ``weight``, else why not."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return f"it multiplies float32 weights on the CPU, not {weight.dtype} on {weight.device.type}"
    if not weight.is_contiguous():
        return "it needs contiguous weights"
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


FLOAT = WeightFormat(
    name="float",
    help="the model's own weights in its dtype (float32 on the CPU: fastdecode's row-invariant GEMM)",
    native_linear=make_float_linear,
)
