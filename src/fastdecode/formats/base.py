"""A weight format: one registry entry per numeric model a model's linear layers can be held in.

An entry (:class:`WeightFormat`) binds one CLI name to everything that format needs:

* ``native_linear(weight, bias, float_kernel)``: the native decoder's layer for one
  weight [out_features, in_features] (the projections that read one input fused into
  one matrix), a callable ``[..., in_features] -> [..., out_features]``;
* ``native_layers(model, float_kernel)``: for a format that takes each module's own
  data rather than a fused weight (a GGUF file's blocks), a per-model builder
  (:class:`NativeLayers`); the native decoder uses it instead of ``native_linear``;
* ``quant_config(group_size, **settings)``: the config ``fastdecode.quant.quantize_``
  swaps transformers' ``nn.Linear`` modules by (the transformers path and
  ``fastdecode quantize``); its handler is registered beside it
  (``fastdecode.quant.handlers.register_quant_method``);
* ``saved``: how the modules it swaps in are saved, loaded and named (:class:`SavedLayer`);
* ``native_only``: as ``--weights``, it runs on the native backend only;
* ``listed``: the front ends offer it (``fastdecode.formats.weight_format_names`` and
  the other name lists); ``help``: one line for ``--help``.

How the native decoder builds the layer of the modules that read one input at format
``fmt``: modules already of one saved kind whose :class:`SavedLayer` has ``native``
-> ``saved.native(modules, fused_bias, float_kernel)``; other already low-bit modules
run as they are; plain ``nn.Linear`` modules -> ``layers(modules, fused_bias)`` with
``layers = fmt.native_layers(model, float_kernel)`` made once per model where the
format has one, else ``fmt.native_linear(fused_weight, fused_bias, float_kernel)``.
The numeric model it then runs is ``layers.weights`` (else ``fmt.name``); where the
model holds saved layers, ``layers.weights_with(saved)`` (else the layers counted by
precision, most first), ``saved`` counting their ``precision``
(``fastdecode.quant.api.saved_precisions``).

Adding a format is one new file in this package defining its entries (frozen
:class:`WeightFormat` constants, and the config and handler its module swap needs),
one line in ``formats/__init__.py`` registering them (:func:`register_format`, in the
order the front ends list the names), and its tests under ``tests/formats/``. The
pure quantization math a format uses lives apart, in ``fastdecode.quant.math``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.registry import Registry

Linear = Callable[[torch.Tensor], torch.Tensor]  # [..., in_features] -> [..., out_features]
# (weight [out_features, in_features], bias [out_features] or None, float_kernel) -> the layer
NativeLinear = Callable[[torch.Tensor, torch.Tensor | None, str], Linear]
# (int4 group size or None, **settings) -> a config for fastdecode.quant.quantize_
QuantConfigFactory = Callable[..., object]
FLOAT_KERNELS = ("auto", "rowgemm", "torch")  # the native decoder's float GEMM: fastdecode's where it runs, or torch's


class NativeLayers(Protocol):
    """One model's native layers at one format, each built from the modules that read one
    input (``[q_proj, k_proj, v_proj]``, ``[o_proj]``, ...), from each module's own data."""

    counts: dict[str, int]  # modules taken, by the numeric model each runs ("q4_0", "q5_0", ...)

    def __call__(self, modules: Sequence[nn.Linear], bias: torch.Tensor | None) -> Linear: ...

    @property
    def weights(self) -> str:
        """The numeric model of the layers built so far ("q4_0", "gguf:q4_1+q8_0")."""
        ...

    def weights_with(self, saved: Counter[str]) -> str:
        """The numeric model of the layers built so far beside ``saved``, the modules saved
        low-bit that run as they are, by precision ("q4_0+float", "gguf:q4_0+q8_0")."""
        ...

    @property
    def note(self) -> str | None:
        """Why some layers were not built as asked, or None."""
        ...


NativeLayersFactory = Callable[[nn.Module, str], NativeLayers]  # (model, float_kernel) -> builder


@dataclass(frozen=True)
class SavedLayer:
    """One kind of quantized module (``fastdecode.quant.linear``): how it is saved
    (``fastdecode.quant.serialization``), named, and run on the native decoder.

    A saved layer is rebuilt empty as ``module(in_features, out_features, bias=...,
    dtype=..., **extras)``, the extras being its layout record's ``group_size`` and
    ``format``, and then loaded from the weights file."""

    kind: str  # the layout record's "kind": "int8", "int4", "gguf_block"
    module: type[nn.Module]
    layout: Callable[[nn.Module], dict]  # a module -> its layout record, "kind" first
    precision: Callable[[nn.Module], str]  # a module -> the numeric model it runs ("int4", "q4_0")
    # (modules of this kind reading one input, their fused bias, float_kernel) -> one native layer;
    # None: the native decoder calls each module as it is
    native: Callable[[Sequence[nn.Module], torch.Tensor | None, str], Linear] | None = None


@dataclass(frozen=True)
class WeightFormat:
    """One weight format (the module docstring describes each field)."""

    name: str
    help: str
    native_linear: NativeLinear | None = None
    native_layers: NativeLayersFactory | None = None
    quant_config: QuantConfigFactory | None = None
    saved: SavedLayer | None = None
    native_only: bool = False
    listed: bool = True

    @property
    def runs_as_weights(self) -> bool:
        """A target can run it (``--weights``)."""
        return self.native_linear is not None or self.native_layers is not None


class _FormatRegistry(Registry[str, WeightFormat]):
    def __iter__(self) -> Iterator[WeightFormat]:
        """The entries in the order they were registered (the order front ends list them in)."""
        return iter(self._entries.values())


WEIGHT_FORMATS: _FormatRegistry = _FormatRegistry("weight format")


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Add ``fmt`` under its name (a name registered twice raises ValueError)."""
    return WEIGHT_FORMATS.register(fmt.name)(fmt)


@dataclass(frozen=True)
class CompressionMethod:
    """A compression method that is not a format of its own (AWQ, SmoothQuant): it changes the
    float weights (scales folded into the operations before them, clipping) and then rounds
    them to a registered format, whose :class:`SavedLayer` its layers are saved as. A name for
    ``compress --method`` and ``fastdecode.quant.config_from_method``; never ``--weights`` or
    ``--draft-quant`` (a method needs calibration)."""

    name: str
    help: str
    quant_config: QuantConfigFactory  # (group_size or None, **settings) -> its config
    formats: tuple[str, ...]  # the registered formats its layers come out in, the default first
    drafts: bool = True  # a --draft-quant choice (pruning's float output drafts no faster: False)
    lm_head: bool = False  # ``compress`` quantizes the LM head unless told not to (--no-include-lm-head)


class _MethodRegistry(Registry[str, CompressionMethod]):
    def __iter__(self) -> Iterator[CompressionMethod]:
        """The methods in the order they were registered."""
        return iter(self._entries.values())


COMPRESSION_METHODS: _MethodRegistry = _MethodRegistry("compression method")


def register_method(method: CompressionMethod) -> CompressionMethod:
    """Add ``method`` under its name (a name registered twice raises ValueError)."""
    return COMPRESSION_METHODS.register(method.name)(method)


def check_float_kernel(float_kernel: str) -> None:
    if float_kernel not in FLOAT_KERNELS:
        raise ConfigError(f"unknown float kernel {float_kernel!r}; choose one of {', '.join(FLOAT_KERNELS)}")


def refuse_group_size(method: str, group_size: int | None, why: str) -> None:
    """For a quant config that takes no group size: ``why`` says what it does instead."""
    if group_size is not None:
        raise ConfigError(f"{method} {why} and takes no group size (got {group_size})")


def refuse_settings(method: str, settings: dict) -> None:
    if settings:
        raise ConfigError(f"{method} takes no settings beyond group_size (got {sorted(settings)})")


def linear_weight_bytes(layer) -> int:
    """Bytes one call of ``layer`` reads for its weights (0 if unknown)."""
    if hasattr(layer, "weight_bytes"):
        return layer.weight_bytes()
    if isinstance(layer, torch.nn.Linear):
        return sum(p.numel() * p.element_size() for p in layer.parameters())
    return sum(linear_weight_bytes(m) for m in getattr(layer, "parts", ()))
