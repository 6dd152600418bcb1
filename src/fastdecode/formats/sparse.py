"""Pruning's entries: the compression methods ``magnitude``, ``wanda`` and ``sparsegpt``
(``fastdecode.quant.pruning``), and the weight formats their 2:4 output runs in: ``sparse24``
(q8_0 values) and ``sparse24-f32`` (float32 values, exactly the pruned float model).

``compress --method wanda --pattern 2:4 [--then q8_0] --out DIR`` prunes (and quantizes);
``--weights sparse24`` (a ``--then q8_0`` directory) or ``--weights sparse24-f32`` (a float one)
runs 2:4-sparse weights on the native decoder in a layout that stores only the kept half
(:mod:`fastdecode.kernels.sparse`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.base import COMPRESSION_METHODS, WEIGHT_FORMATS, CompressionMethod, WeightFormat
from fastdecode.formats.float import float_kernel_unavailable, make_float_linear
from fastdecode.formats.gguf import BlockLinear, PackedNativeLinear, block_kernel
from fastdecode.kernels.gguf_blocks import BlockTensor, stack_rows
from fastdecode.kernels.quant import Projection, block_linear_reference
from fastdecode.kernels.sparse import is_2_4, pack_s24, pack_s24_f32, sparse_bytes, sparse_f32_bytes
from fastdecode.quant.linear import GGUFBlockLinear
from fastdecode.quant.pruning import FILLING_METHODS, PRUNING_METHODS, PruneConfig
from fastdecode.quant.sparsity import magnitude_score, nm_mask

_PRUNE_FIELDS = {f.name for f in dataclasses.fields(PruneConfig)} - {"method", "then"}


def then_names() -> tuple[str, ...]:
    """What ``--then`` takes: the formats a model is saved in, then the other compression methods."""
    formats = (f.name for f in WEIGHT_FORMATS if f.listed and f.quant_config is not None and f.saved is not None)
    methods = (m.name for m in COMPRESSION_METHODS if m.name not in PRUNING_METHODS)
    return tuple(name for name in (*formats, *methods) if name not in FILLING_METHODS)


def _then_config(name: str, group_size: int | None, settings: dict):
    if name in FILLING_METHODS:  # PruneConfig says why
        return WEIGHT_FORMATS.get(name).quant_config(group_size, **settings)
    if name not in then_names():
        raise ConfigError(f"--then takes one of {', '.join(then_names())}, not {name!r}")
    entry = COMPRESSION_METHODS.get(name) if name in COMPRESSION_METHODS else WEIGHT_FORMATS.get(name)
    return entry.quant_config(group_size, **settings)


def _pruning_config(method: str):
    def quant_config(group_size: int | None = None, then: str | None = None, **settings) -> PruneConfig:
        """``config_from_method(method, sparsity=... | pattern="2:4", then="q8_0", ...)``: the
        settings PruneConfig does not take (and the group size) go to ``then``'s config."""
        own = {k: v for k, v in settings.items() if k in _PRUNE_FIELDS}
        rest = {k: v for k, v in settings.items() if k not in _PRUNE_FIELDS}
        if then is None and (rest or group_size is not None):
            raise ConfigError(
                f"{method} without --then keeps float weights: it takes no {sorted(rest) or 'group size'}"
            )
        then_config = None if then is None else _then_config(then, group_size, rest)
        return PruneConfig(method=method, then=then_config, **own)

    return quant_config


_SHAPE = "to --sparsity S (unstructured, default 0.5) or --pattern N:M (2:4, 4:8); --then FORMAT to quantize after"
MAGNITUDE = CompressionMethod(
    name="magnitude",
    help=f"magnitude pruning (|W|, per layer) {_SHAPE}",
    quant_config=_pruning_config("magnitude"),
    formats=("float",),
    drafts=False,
)
WANDA = CompressionMethod(
    name="wanda",
    help=f"Wanda pruning (|W| x ||X||2 per input channel, per output row; calibrated) {_SHAPE}",
    quant_config=_pruning_config("wanda"),
    formats=("float",),
    drafts=False,
)
SPARSEGPT = CompressionMethod(
    name="sparsegpt",
    help=f"SparseGPT pruning (OBS reconstruction from the calibration Hessian) {_SHAPE}; "
    "with --then q8_0|q4_0 it rounds jointly",
    quant_config=_pruning_config("sparsegpt"),
    formats=("float", "q8_0", "q4_0"),
    drafts=False,
)
PRUNING = (MAGNITUDE, WANDA, SPARSEGPT)


# ---------------------------------------------------------------- the sparse24 weight format


class Sparse24Linear(PackedNativeLinear):
    """Q8_0 weights that are 2:4 sparse along the input, stored as their kept half
    (``kernels/sparse.c``: 22 bytes a block of 32 where Q8_0 takes 34), each row of
    activations quantized to 8-bit blocks: the dense q8_0 layer's numeric model, bit for bit
    (:class:`~fastdecode.formats.gguf.BlockLinear` over the same blocks), row-invariant.
    ``kernel``: ``s24`` the C kernels, ``torch`` the dense reference in torch ops."""

    def __init__(self, weight: BlockTensor, bias: torch.Tensor | None, kernel: str = "s24") -> None:
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.kernel = kernel
        self.projection = self.blocks = None
        if kernel == "s24":
            self.projection = Projection([pack_s24(weight)], self.bias, self.in_features)
        elif kernel == "torch":
            self.blocks = weight
        else:
            raise ConfigError(f"unknown sparse kernel {kernel!r}")

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear_reference(x, [self.blocks], self.bias)

    def data_bytes(self) -> int:
        return sparse_bytes(self.out_features, self.in_features)


def prune_2_4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] with the two smallest |w| of every four inputs set to +0.0 (a float32
    copy; a weight already 2:4 keeps its values: its zeros are the smallest). 4 must divide in."""
    w = weight.detach().float()
    if w.dim() == 2 and not w.shape[1] % 4 and bool(((w.reshape(w.shape[0], -1, 4) != 0).sum(-1) <= 2).all()):
        return w + 0.0  # already 2:4 (a compressed directory): no scoring; + 0.0 makes any -0.0 +0.0
    return torch.where(nm_mask(magnitude_score(w), 2, 4), w, torch.zeros((), dtype=w.dtype))


def _sparse_kernel(float_kernel: str) -> str:
    return "s24" if block_kernel(float_kernel) == "qdot" else "torch"


def make_sparse24_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str) -> Sparse24Linear:
    """One weight, pruned 2:4 by magnitude unless it is 2:4 already, rounded to q8_0 blocks."""
    if weight.shape[1] % 4:
        raise ConfigError(f"sparse24 prunes 2 of every 4 inputs: in_features {weight.shape[1]} is not a multiple of 4")
    return Sparse24Linear(BlockTensor.quantize(prune_2_4(weight), "q8_0"), bias, _sparse_kernel(float_kernel))


class Sparse24F32Linear(PackedNativeLinear):
    """float32 weights that are 2:4 sparse along the input, stored as their kept half
    (``kernels/sparse_f32.c``: 68 bytes a row's 32 weights where float32 takes 128): the dense
    float32 row-invariant GEMM's bits over the same weights (``RowInvariantLinear``), row-invariant."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.projection = Projection([pack_s24_f32(weight)], self.bias, self.in_features)

    def data_bytes(self) -> int:
        return sparse_f32_bytes(self.out_features, self.in_features)


def _sparse_f32_layer(pruned: torch.Tensor, bias: torch.Tensor | None, float_kernel: str):
    """The sparse kernel over float32 ``pruned``, or the dense float layer where it cannot run
    (``--float-kernel torch``, or no C library: F.linear over the same weights)."""
    if float_kernel == "torch" or float_kernel_unavailable(pruned) is not None:
        return make_float_linear(pruned, bias, float_kernel)
    return Sparse24F32Linear(pruned, bias)


def make_sparse24_f32_linear(weight: torch.Tensor, bias: torch.Tensor | None, float_kernel: str):
    """One weight, pruned 2:4 by magnitude unless it is 2:4 already, its values kept in float32."""
    if weight.shape[1] % 4:
        raise ConfigError(
            f"sparse24-f32 prunes 2 of every 4 inputs: in_features {weight.shape[1]} is not a multiple of 4"
        )
    return _sparse_f32_layer(prune_2_4(weight), bias, float_kernel)


class SparseWeights:
    """Builds one model's ``sparse24`` or ``sparse24-f32`` layers (``values`` ``q8_0`` or ``f32``; a
    :class:`~fastdecode.formats.base.NativeLayers`): the decoder's projections as
    :class:`Sparse24Linear` / :class:`Sparse24F32Linear` (pruned 2:4 by magnitude where they are not
    2:4 already: prune with ``compress --method wanda|sparsegpt --pattern 2:4`` for quality); the LM
    head, and a weight 4 does not divide, dense (q8_0, or float). :meth:`adopt` takes saved q8_0
    modules (``compress --pattern 2:4 --then q8_0``) whose blocks are 2:4 onto the q8_0 kernel."""

    def __init__(self, model: nn.Module, float_kernel: str = "auto", values: str = "q8_0") -> None:
        self.name = {"q8_0": "sparse24", "f32": "sparse24-f32"}[values]
        self.float_kernel = float_kernel
        self.kernel = _sparse_kernel(float_kernel)
        self.head = model.get_output_embeddings()
        self.counts: Counter[str] = Counter()
        self.pruned = 0  # modules pruned here by magnitude

    def __call__(self, modules: Sequence[nn.Linear], bias: torch.Tensor | None):
        if any(m is self.head for m in modules) or any(m.in_features % 4 for m in modules):
            return self._dense(modules, bias)
        weights = [prune_2_4(m.weight) for m in modules]
        self.pruned += sum(not torch.equal(w, m.weight.detach().float()) for w, m in zip(weights, modules))
        self.counts[self.name] += len(modules)
        if self.name == "sparse24-f32":
            return _sparse_f32_layer(torch.cat(weights), bias, self.float_kernel)
        return Sparse24Linear(stack_rows([BlockTensor.quantize(w, "q8_0") for w in weights]), bias, self.kernel)

    def _dense(self, modules: Sequence[nn.Linear], bias: torch.Tensor | None):
        if self.name == "sparse24-f32":
            self.counts["float"] += len(modules)
            weight = modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules])
            return make_float_linear(weight.detach(), bias, self.float_kernel)
        self.counts["q8_0"] += len(modules)
        dense = [BlockTensor.quantize(m.weight, "q8_0") for m in modules]
        return BlockLinear(dense, bias, "qdot" if self.kernel == "s24" else "torch")

    def adopt(self, modules: Sequence[nn.Module], bias: torch.Tensor | None) -> Sparse24Linear | None:
        """Saved modules onto the sparse kernel where they are q8_0 blocks 2:4 sparse; else None."""
        if self.name != "sparse24" or not all(isinstance(m, GGUFBlockLinear) and m.format == "q8_0" for m in modules):
            return None
        blocks = stack_rows([m.block_tensor() for m in modules])
        if not is_2_4(blocks.fields()[0]):
            return None
        self.counts["sparse24"] += len(modules)
        return Sparse24Linear(blocks, bias, self.kernel)

    @property
    def weights(self) -> str:
        return self.weights_with(Counter())

    def weights_with(self, saved: Counter) -> str:
        kinds = saved + self.counts
        return "+".join(sorted(kinds, key=lambda f: -kinds[f])) or self.name

    @property
    def note(self) -> str | None:
        if not self.pruned:
            return None
        return (
            f"--weights {self.name}: {self.pruned} linear layers were not 2:4 sparse and were pruned by magnitude "
            "(fastdecode compress --method wanda|sparsegpt --pattern 2:4 prunes with far less loss)"
        )


SPARSE24 = WeightFormat(
    name="sparse24",
    help="2:4 sparse q8_0: the kept half of each q8_0 block and 2-bit positions, on an AVX2 kernel giving "
    "q8_0's bits (weights not 2:4 yet are pruned by magnitude; the LM head stays q8_0)",
    native_linear=make_sparse24_linear,
    native_layers=lambda model, float_kernel: SparseWeights(model, float_kernel),
    native_only=True,
)
SPARSE24_F32 = WeightFormat(
    name="sparse24-f32",
    help="2:4 sparse float32: the kept half of each row's values and a mask bit a weight, on a kernel giving "
    "the dense float32 GEMM's bits (weights not 2:4 yet are pruned by magnitude; the LM head stays float)",
    native_linear=make_sparse24_f32_linear,
    native_layers=lambda model, float_kernel: SparseWeights(model, float_kernel, "f32"),
    native_only=True,
)
