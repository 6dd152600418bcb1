"""Linear layers for the native decoder, by weight precision.

``float``: the model's own weight in the model's dtype. In float32 on a CPU
the ``auto`` kernel is fastdecode's row-invariant GEMM
(``fastdecode.kernels.cpu``) for decode and verification passes, where a row
must get the same bits whatever the row count; otherwise ``F.linear``.
``int8``: the same kernel over int8 weights where it runs (float32
activations), else fastdecode's weight-only quantized layer on torch's packed
kernel. ``int4``: fastdecode's quantized layer (``fastdecode.quant``) on
torch's packed int4 kernel. ``q8_0``, ``q4_0``, ``q4_1``: GGUF's block formats
(``fastdecode.gguf_blocks``) quantized from the float weights, on integer dot
products (``fastdecode.kernels.quant``); ``gguf``: the model's GGUF file's own
blocks where they are in one of those formats or the K-quants Q4_K / Q6_K, q8_0
elsewhere.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fastdecode.errors import ConfigError

BLOCK_PRECISIONS = ("q8_0", "q4_0", "q4_1", "gguf")
WEIGHT_PRECISIONS = ("float", "int8", "int4", *BLOCK_PRECISIONS)
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
    row_invariant = True  # a row's bits do not depend on the row count

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from fastdecode.kernels.cpu import rowgemm

        return rowgemm(x, self.weight, self.bias)

    def layer_projection(self):
        """The projection as fastdecode.kernels.cpu.DecoderLayerKernel takes it."""
        return self.weight, None, self.bias


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
        from fastdecode.quant.math import quantize_int8_per_channel

        qweight, scales = quantize_int8_per_channel(weight.detach())
        self.qweight = qweight.contiguous()  # int8 [out_features, in_features]
        self.scales = scales.to(torch.float32).contiguous()  # [out_features]
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self.out_features = self.qweight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from fastdecode.kernels.cpu import rowgemm_i8

        return rowgemm_i8(x, self.qweight, self.scales, self.bias)

    def layer_projection(self):
        return self.qweight, self.scales, self.bias

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.bias) if t is not None)


class BlockLinear:
    """Weights in GGUF's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: ``fastdecode.gguf_blocks``),
    each row of activations quantized to 8-bit blocks, integer dot products
    (``fastdecode.kernels.quant``): ggml's numeric model, with the activation scales
    kept in float32. Row-invariant on every path, so speculative decoding is
    lossless against it.

    parts: [out_i, in_features] block tensors stacked by output (a fused QKV
    whose q, k and v are in different formats keeps each its own). ``kernel``:
    ``qdot`` the C kernels (AVX2), ``torch`` the reference in torch ops - the
    same bits, slower."""

    row_invariant = True

    def __init__(self, parts: Sequence, bias: torch.Tensor | None, kernel: str = "qdot") -> None:
        from fastdecode.gguf_blocks import stack_rows

        merged = []  # neighbours in one format share a part
        for part in parts:
            if merged and merged[-1][-1].format == part.format:
                merged[-1].append(part)
            else:
                merged.append([part])
        self.parts = [group[0] if len(group) == 1 else stack_rows(group) for group in merged]
        self.formats = [p.format.name for p in self.parts]
        self.in_features = self.parts[0].cols
        self.out_features = sum(p.rows for p in self.parts)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.kernel = kernel
        self.projection = None
        if kernel == "qdot":
            from fastdecode.kernels.quant import Projection, pack

            self.projection = Projection([pack(p) for p in self.parts], self.bias, self.in_features)
            self._bytes = sum(p.nbytes() for p in self.parts)
            self.parts = None  # the packed copy is the one used
        elif kernel != "torch":
            raise ConfigError(f"unknown block kernel {kernel!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.projection is None:
            from fastdecode.kernels.quant import block_linear_reference

            return block_linear_reference(x, self.parts, self.bias).to(x.dtype)
        if x.dtype != torch.float32:
            return self.projection(x.float()).to(x.dtype)
        return self.projection(x)

    def layer_projection(self):
        return self.projection

    def weight_bytes(self) -> int:
        data = self._bytes if self.projection is not None else sum(p.nbytes() for p in self.parts)
        return data + (0 if self.bias is None else self.bias.numel() * 4)


def block_kernel(float_kernel: str = "auto") -> str:
    """The :class:`BlockLinear` kernel ``float_kernel`` asks for: ``qdot`` (C) where it runs,
    else ``torch``; ``torch`` always; ``rowgemm`` where the C kernels cannot run is a ConfigError."""
    if float_kernel == "torch":
        return "torch"
    from fastdecode.kernels.quant import kernel_unavailable

    reason = kernel_unavailable()
    if reason is not None and float_kernel == "rowgemm":
        raise ConfigError(f"--float-kernel rowgemm cannot run here: {reason}")
    return "torch" if reason is not None else "qdot"


class BlockWeights:
    """Builds the :class:`BlockLinear` layers of one model at one block precision and
    names the numeric model that results (``weights``: ``q4_0``, or for ``gguf`` the
    formats taken, most layers first, e.g. ``gguf:q4_1+q8_0`` or ``gguf:q8_0+q4_k+q6_k``).

    ``gguf`` reads the model's GGUF file (``model.config.fastdecode_gguf_file``, set
    by ``fastdecode.loading``) and takes each module's tensor in the file's own type
    where the kernels run it (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; Q5_0 as the Q8_0 blocks of
    its exact weights, counted as q5_0); a module whose tensor is in another type (Q5_1,
    float), or that the file does not hold, is quantized to q8_0 from the model's float
    weight (counted as q8_0), and ``note`` says how many."""

    def __init__(self, model, precision: str, float_kernel: str = "auto") -> None:
        from fastdecode.gguf_blocks import GGUFBlocks

        if precision not in BLOCK_PRECISIONS:
            raise ConfigError(f"unknown block precision {precision!r}; choose one of {', '.join(BLOCK_PRECISIONS)}")
        self.precision = precision
        device = next(model.parameters()).device
        if device.type != "cpu":
            raise ConfigError(f"--weights {precision} (GGUF block formats) runs on the CPU, not {device}")
        self.kernel = block_kernel(float_kernel)
        path = getattr(model.config, "fastdecode_gguf_file", None) if precision == "gguf" else None
        self.gguf = GGUFBlocks(path) if path else None
        self._names = {id(m): name for name, m in model.named_modules()}
        config = model.config
        self._heads = (getattr(config, "num_attention_heads", 0) or 0, getattr(config, "num_key_value_heads", 0) or 0)
        self.counts: dict[str, int] = {}
        self.fallbacks: list[str] = []

    def _part(self, module):
        from fastdecode.gguf_blocks import BlockTensor

        fmt = "q8_0" if self.precision == "gguf" else self.precision
        if self.precision == "gguf":
            name = self._names.get(id(module), "?")
            if self.gguf is None:
                self.fallbacks.append(f"{name}: the model has no GGUF file")
            else:
                blocks, why = self.gguf.matching(name, module.weight, *self._heads)
                if blocks is not None:
                    kind = blocks.file_type or blocks.format.name  # Q5_0 runs as the Q8_0 of its exact weights
                    self.counts[kind] = self.counts.get(kind, 0) + 1
                    return blocks
                self.fallbacks.append(f"{name}: {why}")
        self.counts[fmt] = self.counts.get(fmt, 0) + 1
        return BlockTensor.quantize(module.weight, fmt)

    def __call__(self, modules: Sequence[torch.nn.Linear], bias: torch.Tensor | None) -> BlockLinear:
        return BlockLinear([self._part(m) for m in modules], bias, self.kernel)

    @property
    def weights(self) -> str:
        if self.precision != "gguf":
            return self.precision
        return "gguf:" + "+".join(sorted(self.counts, key=lambda f: -self.counts[f]))

    @property
    def note(self) -> str | None:
        if not self.fallbacks:
            return None
        if self.gguf is None:
            return "--weights gguf: the model was not loaded from a GGUF file; every linear layer is q8_0"
        return (f"--weights gguf: {len(self.fallbacks)} linear layers quantized to q8_0 from the float weights "
                f"(first: {self.fallbacks[0]})")


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
    ``float``, ``int8`` and the block formats (torch: their reference in torch ops);
    ``int4`` always runs torch's packed kernel."""
    if float_kernel not in FLOAT_KERNELS:
        raise ConfigError(f"unknown float kernel {float_kernel!r}; choose one of {', '.join(FLOAT_KERNELS)}")
    if precision == "float":
        return make_float_linear(weight, bias, float_kernel)
    if precision in BLOCK_PRECISIONS:  # one weight, no model: quantized from the float weight
        if precision == "gguf":
            raise ConfigError("--weights gguf takes the model's own GGUF blocks: build the layers with BlockWeights")
        from fastdecode.gguf_blocks import BlockTensor

        kernel = "torch" if float_kernel == "torch" else "qdot"
        if kernel == "qdot":
            from fastdecode.kernels.quant import kernel_unavailable

            kernel = "torch" if kernel_unavailable() is not None else kernel
        return BlockLinear([BlockTensor.quantize(weight, precision)], bias, kernel)
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
