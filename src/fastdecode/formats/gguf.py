"""GGUF's block formats (``fastdecode.kernels.gguf_blocks``): ``q8_0``, ``q4_0`` and ``q4_1``
quantized from the float weights with ggml's rounding, and ``gguf``: the model's GGUF
file's own blocks in every type ``fastdecode.kernels.gguf_types`` runs (the legacy and K-quant
types, IQ4_NL, IQ4_XS, MXFP4, the float types), q8_0 elsewhere.

Each row of activations is quantized to 8-bit blocks and meets the weight blocks in
integer dot products (``fastdecode.kernels.quant``): ggml's numeric model, with the
activation scales kept in float32, row-invariant on every path. As ``--weights`` they
run on the native decoder only; ``fastdecode quantize --method q8_0|q4_0|q4_1`` saves
them as ``GGUFBlockLinear`` modules, which compute the same bits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdecode.errors import ConfigError
from fastdecode.formats.base import SavedLayer, WeightFormat, refuse_group_size, refuse_settings
from fastdecode.formats.gguf_match import GGUFBlocks
from fastdecode.kernels.gguf_blocks import FORMATS as BLOCK_FORMATS
from fastdecode.kernels.gguf_blocks import BlockTensor, stack_rows
from fastdecode.kernels.quant import Projection, block_linear_reference, kernel_unavailable, pack
from fastdecode.loaders.gguf_model import ATTR as GGUF_ATTR
from fastdecode.loaders.gguf_model import is_lazy, model_device
from fastdecode.quant.handlers import register_quant_method, set_module
from fastdecode.quant.linear import GGUFBlockLinear

BLOCK_PRECISIONS = (*BLOCK_FORMATS, "gguf")  # "q8_0", "q4_0", "q4_1", "gguf"

# ---------------------------------------------------------------- native decoder


class PackedNativeLinear:
    """A native-decoder layer over one packed :class:`~fastdecode.kernels.quant.Projection` (the C
    kernels), or, where ``projection`` is None, the format's torch reference (:meth:`reference`),
    the same bits. float32 in the kernel; out in the input's dtype. Row-invariant. A format's
    layer sets ``projection``, ``bias`` and the features and says its own weight bytes
    (:meth:`data_bytes`)."""

    row_invariant = True
    projection = None
    bias: torch.Tensor | None = None

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no torch reference")

    def data_bytes(self) -> int:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.projection is None:
            return self.reference(x).to(x.dtype)
        if x.dtype != torch.float32:
            return self.projection(x.float()).to(x.dtype)
        return self.projection(x)

    def layer_projection(self):
        return self.projection

    def weight_bytes(self) -> int:
        return self.data_bytes() + (0 if self.bias is None else self.bias.numel() * 4)


class BlockLinear(PackedNativeLinear):
    """Weights in GGUF's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K: ``fastdecode.kernels.gguf_blocks``),
    each row of activations quantized to 8-bit blocks, integer dot products
    (``fastdecode.kernels.quant``): ggml's numeric model, with the activation scales
    kept in float32. Row-invariant on every path, so speculative decoding is
    lossless against it.

    parts: [out_i, in_features] block tensors stacked by output (a fused QKV
    whose q, k and v are in different formats keeps each its own), each a
    ``BlockTensor`` or rows of one in another order (``BlockRows``: Llama's
    un-permuted q and k), packed where they lie: neighbours in one format
    become one packed part, with no copy but the packed one. ``kernel``:
    ``qdot`` the C kernels (AVX2), ``torch`` the reference in torch ops - the
    same bits, slower."""

    def __init__(self, parts: Sequence, bias: torch.Tensor | None, kernel: str = "qdot") -> None:
        merged = []  # neighbours in one format share a part
        for part in parts:
            if merged and merged[-1][-1].format == part.format:
                merged[-1].append(part)
            else:
                merged.append([part])
        self.formats = [group[0].format.name for group in merged]
        self.in_features = merged[0][0].cols
        self.out_features = sum(p.rows for group in merged for p in group)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.kernel = kernel
        self.projection = None
        self.parts = None  # kernel "torch": the reference's stacked tensors; "qdot": the packed copy is the one used
        if kernel == "qdot":
            self.projection = Projection([pack(group) for group in merged], self.bias, self.in_features)
            self._bytes = sum(p.nbytes() for group in merged for p in group)
        elif kernel == "torch":
            self.parts = [g[0] if len(g) == 1 and isinstance(g[0], BlockTensor) else stack_rows(g) for g in merged]
        else:
            raise ConfigError(f"unknown block kernel {kernel!r}")

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear_reference(x, self.parts, self.bias)

    def data_bytes(self) -> int:
        return self._bytes if self.projection is not None else sum(p.nbytes() for p in self.parts)


def block_kernel(float_kernel: str = "auto") -> str:
    """The :class:`BlockLinear` kernel ``float_kernel`` asks for: ``qdot`` (C) where it runs,
    else ``torch``; ``torch`` always; ``rowgemm`` where the C kernels cannot run is a ConfigError."""
    if float_kernel == "torch":
        return "torch"
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
    where the kernels run it (every type of ``fastdecode.kernels.gguf_types.GGUF_TYPES``, each
    counted by its name: ``gguf:q8_0+mxfp4``); a module whose tensor is in another type, or that
    the file does not hold, is quantized to q8_0 from the model's float
    weight (counted as q8_0), and ``note`` says how many."""

    def __init__(self, model, precision: str, float_kernel: str = "auto") -> None:
        if precision not in BLOCK_PRECISIONS:
            raise ConfigError(f"unknown block precision {precision!r}; choose one of {', '.join(BLOCK_PRECISIONS)}")
        self.precision = precision
        device = model_device(model)
        if device.type != "cpu":
            raise ConfigError(f"--weights {precision} (GGUF block formats) runs on the CPU, not {device}")
        self.kernel = block_kernel(float_kernel)
        path = getattr(model.config, "fastdecode_gguf_file", None) if precision == "gguf" else None
        # a GGUF skeleton's layers carry their tensors; a float model loaded otherwise is matched against the file
        self.lazy = is_lazy(model)
        self.gguf = GGUFBlocks(path) if path and not self.lazy else None
        self._names = {id(m): name for name, m in model.named_modules()}
        config = model.config
        self._heads = (getattr(config, "num_attention_heads", 0) or 0, getattr(config, "num_key_value_heads", 0) or 0)
        self.counts: dict[str, int] = {}
        self.fallbacks: list[str] = []

    def _file_part(self, module, ref):
        """A GGUF skeleton's layer (``fastdecode.loaders.gguf_model``): its blocks straight from the file,
        or, for a type no kernel here runs, q8_0 from that one tensor's values."""
        blocks = ref.blocks()
        if blocks is not None:
            kind = blocks.file_type or blocks.format.name
            self.counts[kind] = self.counts.get(kind, 0) + 1
            return blocks
        self.fallbacks.append(f"{ref.name}: {ref.type_name}")
        self.counts["q8_0"] = self.counts.get("q8_0", 0) + 1
        return BlockTensor.quantize(ref.float_weight(), "q8_0")

    def _part(self, module):
        fmt = "q8_0" if self.precision == "gguf" else self.precision
        ref = getattr(module, GGUF_ATTR, None)
        if ref is not None and self.precision == "gguf":
            return self._file_part(module, ref)
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
        # a skeleton's layer (a safetensors directory read lazily): quantized from its own tensor, read now
        return BlockTensor.quantize(module.weight if ref is None else ref.float_weight(), fmt)

    def __call__(self, modules: Sequence[torch.nn.Linear], bias: torch.Tensor | None) -> BlockLinear:
        parts = [self._part(m) for m in modules]
        if len({p.format.is_float for p in parts}) > 1:
            # one projection runs float parts or block parts, not both: a float part beside blocks
            # (F16 k beside Q4_K q in one fused QKV) is taken as q8_0 of its values
            for i, p in enumerate(parts):
                if p.format.is_float:
                    self.counts[p.format.name] -= 1
                    self.counts["q8_0"] = self.counts.get("q8_0", 0) + 1
                    self.fallbacks.append(f"{self._names.get(id(modules[i]), '?')}: {p.format.name} beside blocks")
                    parts[i] = BlockTensor.quantize(p.dequantize(), "q8_0")
        return BlockLinear(parts, bias, self.kernel)

    @property
    def weights(self) -> str:
        if self.precision != "gguf":
            return self.precision
        return self.weights_with(Counter())

    def weights_with(self, saved: Counter) -> str:
        """The numeric model of these layers beside ``saved`` (modules saved low-bit, by precision),
        most layers first: "q4_0+float"; "gguf:" first for ``gguf``."""
        kinds = saved + Counter(self.counts)
        return ("gguf:" if self.precision == "gguf" else "") + "+".join(sorted(kinds, key=lambda f: -kinds[f]))

    @property
    def note(self) -> str | None:
        if not self.fallbacks:
            return None
        if self.lazy:
            return (
                f"--weights gguf: {len(self.fallbacks)} tensors are of a type no kernel here runs; each was "
                f"quantized to q8_0 from its own values (first: {self.fallbacks[0]})"
            )
        if self.gguf is None:
            return "--weights gguf: the model was not loaded from a GGUF file; every linear layer is q8_0"
        return (
            f"--weights gguf: {len(self.fallbacks)} linear layers quantized to q8_0 from the float weights "
            f"(first: {self.fallbacks[0]})"
        )


def _block_native_linear(fmt: str):
    def native_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str) -> BlockLinear:
        """One weight quantized to ``fmt``: the C kernels where they run (unless ``float_kernel="torch"``), else torch's reference."""
        kernel = "torch" if float_kernel == "torch" else "qdot"
        if kernel == "qdot":
            kernel = "torch" if kernel_unavailable() is not None else kernel
        return BlockLinear([BlockTensor.quantize(weight, fmt)], bias, kernel)

    return native_linear


def _block_native_layers(fmt: str):
    return lambda model, float_kernel: BlockWeights(model, fmt, float_kernel)


def _gguf_needs_the_model(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str):
    raise ConfigError("--weights gguf takes the model's own GGUF blocks: build the layers with BlockWeights")


def _saved_blocks_native(
    modules: Sequence[GGUFBlockLinear], bias: torch.Tensor | None, float_kernel: str
) -> BlockLinear:
    """Saved block modules on the native decoder: their blocks stacked as ``--weights q4_0`` stacks its own (the same bits)."""
    return BlockLinear([m.block_tensor() for m in modules], bias, block_kernel(float_kernel))


# ---------------------------------------------------------------- transformers: config and handler


@dataclass(frozen=True)
class GGUFBlockConfig:
    """GGUF's block formats with ggml's rounding (``fastdecode.kernels.gguf_blocks``): ``q8_0``
    (int8 and an fp16 scale per 32 weights), ``q4_0`` (4 bits, symmetric) or ``q4_1``
    (4 bits, scale and minimum).

    The quantized layers compute what ``--weights q8_0|q4_0|q4_1`` computes on the
    native backend from the same float model, bit for bit, and the native backend
    runs them on its block kernels. Any layer shape is accepted (a row whose length
    32 does not divide is padded with zero weights).
    """

    format: str = "q4_0"

    def __post_init__(self) -> None:
        if self.format not in BLOCK_FORMATS:
            raise ConfigError(f"unknown GGUF block format {self.format!r}; choose one of {', '.join(BLOCK_FORMATS)}")

    @property
    def method(self) -> str:
        return self.format

    def to_dict(self) -> dict:
        return {"method": self.method}


@register_quant_method(GGUFBlockConfig)
def _quantize_gguf_blocks(model, targets, config, tokenizer) -> None:
    for name, linear in targets.items():
        set_module(model, name, GGUFBlockLinear.from_float(linear, config.format))


def _block_config(fmt: str):
    def quant_config(group_size: int | None = None, **settings) -> GGUFBlockConfig:
        refuse_group_size(fmt, group_size, "quantizes in fixed blocks of 32 weights")
        refuse_settings(fmt, settings)
        return GGUFBlockConfig(fmt)

    return quant_config


# ---------------------------------------------------------------- the entries

GGUF_BLOCK_LAYER = SavedLayer(
    "gguf_block",
    GGUFBlockLinear,
    layout=lambda m: {"kind": "gguf_block", "format": m.format, "shape": [m.out_features, m.in_features]},
    precision=lambda m: m.format,
    native=_saved_blocks_native,
)


def _block_format(fmt: str, help_text: str) -> WeightFormat:
    return WeightFormat(
        name=fmt,
        help=help_text,
        native_linear=_block_native_linear(fmt),
        native_layers=_block_native_layers(fmt),
        quant_config=_block_config(fmt),
        saved=GGUF_BLOCK_LAYER,
        native_only=True,
    )


Q8_0 = _block_format("q8_0", "GGUF Q8_0 (int8, an fp16 scale per 32 weights) with ggml's rounding")
Q4_0 = _block_format("q4_0", "GGUF Q4_0 (4 bits, symmetric, an fp16 scale per 32 weights) with ggml's rounding")
Q4_1 = _block_format("q4_1", "GGUF Q4_1 (4 bits, an fp16 scale and minimum per 32 weights) with ggml's rounding")
GGUF = WeightFormat(
    name="gguf",
    help="the GGUF file's own blocks, every type on its own kernel (Q8_0 .. Q6_K, IQ4_NL, IQ4_XS, MXFP4, "
    "F16, BF16, F32), q8_0 where it has none",
    native_linear=_gguf_needs_the_model,
    native_layers=_block_native_layers("gguf"),
    native_only=True,
)
