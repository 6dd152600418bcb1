"""The native decoder's linear layers, built from a transformers model at one weight precision.

``NativeLinears(model, weights, float_kernel)`` is the whole interface the decoder uses:

* ``linears(modules)`` turns the projections that read one input (``[q_proj, k_proj,
  v_proj]``, ``[gate_proj, up_proj]``, ``[o_proj]``, the LM head) into one callable
  ``[n, in_features] -> [n, sum of out_features]``;
* after every layer is built, ``linears.weights`` names the numeric model that resulted
  ("float", "int8", "q4_0", "gguf:q4_1+q8_0", "q4_0+float" for a model saved low-bit, ...)
  and ``linears.note`` says why a layer was not taken as asked (None when nothing was).

How a module becomes a layer (each format's part read from its registry entry,
``fastdecode.formats``): modules already of one saved low-bit kind whose
:class:`~fastdecode.formats.SavedLayer` has a native layer (a GGUF block format) run on
it, their blocks stacked as ``--weights q4_0`` stacks its own (the same bits); other
already low-bit modules (``fastdecode.quant``, e.g. GPTQ) are called as they are; plain
``nn.Linear`` projections are built by the format of ``weights``: by its per-model
``native_layers`` where it has them (the GGUF block formats, from each module's own
data), else fused into one matrix (sharing the model's storage, not copied) and
multiplied by its ``native_linear``. A format whose per-model builder has
``adopt(modules, bias)`` is offered saved modules first (``sparse24`` takes saved q8_0
modules that are 2:4 sparse onto its kernel; None leaves them to their own layer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from fastdecode.errors import ConfigError
from fastdecode.formats import SavedLayer, runnable_format, saved_layer_of
from fastdecode.formats.base import check_float_kernel
from fastdecode.quant.api import precision_name, saved_precisions

Linear = Callable[[torch.Tensor], torch.Tensor]  # [n, in_features] -> [n, out_features]


class NativeLinears:
    """Builds linear layers for one model at one weight format (``weights``: one of
    ``fastdecode.formats.weight_format_names()``; ``float_kernel``: one of ``FLOAT_KERNELS``)."""

    def __init__(self, model, weights: str = "float", float_kernel: str = "auto") -> None:
        self.model = model
        self.format = runnable_format(weights)
        self.float_kernel = float_kernel
        factory = self.format.native_layers
        self._layers = factory(model, float_kernel) if factory is not None else None
        self._plain: Counter[str] = Counter()  # the float nn.Linear layers, by the format they run at
        self._adopted: Counter[str] = Counter()  # saved low-bit modules the format took (its layers count them)

    def __call__(self, modules: Sequence[torch.nn.Module]) -> Linear:
        """One layer computing every module of ``modules`` on the same input, outputs side by side."""
        saved = _saved_native(modules)
        if saved is not None:
            adopt = getattr(self._layers, "adopt", None)  # a format may take saved modules onto its kernel
            layer = None if adopt is None else adopt(modules, _fused_bias(modules))
            if layer is not None:
                self._adopted.update(saved.precision(m) for m in modules)
                return layer
            return saved.native(modules, _fused_bias(modules), self.float_kernel)
        if all(type(m) is torch.nn.Linear for m in modules):
            if self._layers is not None:
                return self._layers(modules, _fused_bias(modules))  # each module's own data
            self._plain[self.format.name] += len(modules)
            w, b = _fuse(modules) if len(modules) > 1 else (modules[0].weight, modules[0].bias)
            check_float_kernel(self.float_kernel)
            return self.format.native_linear(w, b, self.float_kernel)
        if len(modules) == 1:
            return modules[0]
        return _Concat(modules)

    @property
    def weights(self) -> str:
        """The numeric model of the layers built so far (read it once every layer is built)."""
        saved = saved_precisions(self.model) - self._adopted  # layers saved low-bit run as they are
        if self._layers is not None:
            return self._layers.weights_with(saved) if saved else self._layers.weights
        # the saved formats with what the rest took, most layers first: "q4_0", "q4_0+float", "int8+float"
        return precision_name(saved + self._plain) if saved else self.format.name

    @property
    def note(self) -> str | None:
        """Why some layers were not built as asked (a GGUF file without some tensors), or None."""
        return self._layers.note if self._layers is not None else None


def _saved_native(modules: Sequence[torch.nn.Module]) -> SavedLayer | None:
    """The saved kind every module of ``modules`` is, where it has a native layer; else None."""
    kind = saved_layer_of(modules[0])
    if kind is None or kind.native is None or any(saved_layer_of(m) is not kind for m in modules[1:]):
        return None
    return kind


class _Concat:
    """Unfused projections (already low-bit modules) called side by side."""

    def __init__(self, parts) -> None:
        self.parts = list(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)


def _fuse(modules: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``modules`` along the output dim and
    re-point each module's parameters at views of the result: one copy, shared.
    A second native target over the same model finds them fused already."""
    return _fused([m.weight for m in modules]), _fused_bias(modules)


def _fused_bias(modules: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    has_bias = [m.bias is not None for m in modules]
    if not any(has_bias):
        return None
    if not all(has_bias):
        raise ConfigError("mixed biased and unbiased projections are not supported natively")
    return _fused([m.bias for m in modules])


def _fused(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    first = params[0].detach()
    rows = sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    step = first[0].numel() * first.element_size()
    ptr = first.data_ptr()
    already = True
    for p in params:
        if (
            p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or p.data_ptr() != ptr
            or not p.is_contiguous()
        ):
            already = False
            break
        ptr += p.shape[0] * step
    if already:
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused
