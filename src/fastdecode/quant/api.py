"""``quantize_(model, config)``: replace a model's ``nn.Linear`` layers in place.

A method is one frozen config dataclass plus one handler registered for its type
(``fastdecode.quant.handlers.register_quant_method``); :func:`quantize_` looks the
handler up and never branches on the method itself. The configs and handlers live
with their weight format (``fastdecode.formats``: int8, int4, the GGUF block formats)
or their compression method (``fastdecode.quant.gptq``, ``awq``, ``smoothquant``) and are
re-exported here; :func:`config_from_method` finds a config by the format's or the
method's registered name.

The LM head is skipped by default (``skip=("lm_head",)``): it is usually tied to
the input embeddings, which must stay float, and on small models it is the layer
most sensitive to rounding. Pass ``skip=()`` to quantize it as well.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Iterable, Sequence

from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats import quant_config_factory, quant_method_names, saved_layer_of
from fastdecode.formats.gguf import GGUFBlockConfig
from fastdecode.formats.torch_packed import Int4WeightOnlyConfig, Int8WeightOnlyConfig
from fastdecode.kernels.gguf_blocks import FORMATS
from fastdecode.loaders.gguf_model import materialize
from fastdecode.quant.awq import AWQConfig
from fastdecode.quant.gptq import GPTQConfig, default_calibration_text
from fastdecode.quant.handlers import QUANT_HANDLERS, QuantHandler, head_is_tied, mark_untied, register_quant_method
from fastdecode.quant.smoothquant import SmoothQuantConfig

__all__ = [
    "AWQConfig",
    "BLOCK_METHODS",
    "DEFAULT_SKIP",
    "QUANT_HANDLERS",
    "GGUFBlockConfig",
    "GPTQConfig",
    "Int4WeightOnlyConfig",
    "Int8WeightOnlyConfig",
    "QuantConfig",
    "QuantHandler",
    "SmoothQuantConfig",
    "config_from_method",
    "default_calibration_text",
    "model_weight_bytes",
    "precision_name",
    "quantize_",
    "quantized_layers",
    "register_quant_method",
    "saved_precisions",
]

DEFAULT_SKIP = ("lm_head",)
QuantConfig = Int8WeightOnlyConfig | Int4WeightOnlyConfig | GPTQConfig | GGUFBlockConfig | AWQConfig | SmoothQuantConfig
BLOCK_METHODS = tuple(FORMATS)  # "q8_0", "q4_0", "q4_1"


def config_from_method(method: str, group_size: int | None = None, **settings) -> QuantConfig:
    """``"int8"``, ``"int4"``, ``"int4-gptq"``, ``"int8-gptq"``, ``"q8_0"``, ``"q4_0"``,
    ``"q4_1"``, ``"awq"`` or ``"smoothquant"`` -> its config (the format's or the method's
    ``quant_config``).

    ``group_size`` applies to the int4 methods and AWQ (default 32); ``settings`` go to the
    config: :class:`GPTQConfig` (calibration, num_samples, ...), :class:`AWQConfig` (bits,
    format, grid, clip, ...), :class:`SmoothQuantConfig` (alpha, ...). A setting the config
    does not take is a ConfigError naming it.
    """
    factory = quant_config_factory(method)
    if factory is None:
        raise ConfigError(f"unknown quantization method {method!r}; choose from {', '.join(quant_method_names())}")
    try:
        return factory(group_size, **settings)
    except TypeError as e:  # a keyword the config's dataclass does not have
        raise ConfigError(f"{method} does not take the settings given ({sorted(settings)}): {e}") from None


def quantize_(
    model: nn.Module,
    config: QuantConfig,
    *,
    tokenizer=None,
    skip: Sequence[str] = DEFAULT_SKIP,
) -> nn.Module:
    """Replace ``model``'s ``nn.Linear`` layers in place with quantized ones; returns ``model``.

    ``skip`` holds fnmatch patterns matched against each Linear's qualified name
    and against its last component (``"lm_head"``, ``"model.layers.0.*"``).
    ``tokenizer`` is needed only by GPTQ calibrating on text.
    """
    materialize(model)  # a GGUF skeleton quantizes from its float values
    handler = QUANT_HANDLERS.get(type(config))
    if isinstance(skip, str):
        skip = (skip,)
    targets = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not _skipped(name, skip)
    }
    for name, module in targets.items():
        if module.weight.device.type != "cpu":
            raise ConfigError(f"quantized layers run torch's CPU kernels; {name} is on {module.weight.device}")
    tied = head_is_tied(model)
    handler(model, targets, config, tokenizer)
    if tied and not head_is_tied(model):  # the head quantized (or smoothed): saved, it must not tie back
        mark_untied(model)
    return model


def _skipped(name: str, patterns: Iterable[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


# ---------------------------------------------------------------- inspection


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes held by ``model``'s parameters and buffers, each storage counted once
    (tied embeddings/LM head count once; the int4 kernel layout counts, being
    what the weights occupy in memory)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type == "meta":
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel())
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


def saved_precisions(model: nn.Module) -> Counter:
    """How many linear layers of ``model`` are already low-bit, by numeric model
    (``int8``, ``int4``, or a block format such as ``q4_0``): a model loaded from
    ``fastdecode quantize`` output carries them whatever ``--weights`` says."""
    return Counter(spec.precision(module) for module in model.modules() if (spec := saved_layer_of(module)) is not None)


def precision_name(layers: Counter) -> str:
    """The numeric model of layers counted by precision, most layers first: "int8+float"."""
    return "+".join(kind for kind, _ in layers.most_common())


def quantized_layers(model: nn.Module) -> dict[str, dict]:
    """Qualified name -> layout record per quantized layer: {"kind": "int8"}, {"kind": "int4",
    "group_size": ...} or {"kind": "gguf_block", "format": "q4_0", "shape": [out, in]}
    (each format's ``SavedLayer.layout``)."""
    layers = {}
    for name, module in model.named_modules():
        spec = saved_layer_of(module)
        if spec is not None:
            layers[name] = spec.layout(module)
    return layers
