"""The handler registry ``fastdecode.quant.quantize_`` dispatches on, and what handlers share.

A quantization method is one frozen config dataclass plus one handler registered for
its type (:func:`register_quant_method`); the weight formats (``fastdecode.formats``)
and the compression methods (``fastdecode.quant.gptq``) register theirs. A handler
receives the ``nn.Linear`` layers to replace, by qualified name, and swaps in
:mod:`fastdecode.quant.linear` modules (:func:`set_module`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.quant.linear import check_int8_shape, int4_group_size_for
from fastdecode.quant.math import INT4_GROUP_SIZES
from fastdecode.registry import Registry

# handler(model, targets, config, tokenizer): replace each targets[name] in `model`.
QuantHandler = Callable[[nn.Module, dict[str, nn.Linear], object, object], None]
QUANT_HANDLERS: Registry[type, QuantHandler] = Registry("quantization config")


def register_quant_method(config_type: type) -> Callable[[QuantHandler], QuantHandler]:
    """Handler decorator: ``quantize_(model, config_type(...))`` calls it."""
    return QUANT_HANDLERS.register(config_type)


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in place of ``model``'s submodule ``name``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def head_is_tied(model: nn.Module) -> bool:
    """Whether ``model``'s LM head shares its weight's storage with the input embeddings."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    w_in, w_out = getattr(get_in(), "weight", None), getattr(get_out(), "weight", None)
    return isinstance(w_in, torch.Tensor) and isinstance(w_out, torch.Tensor) and w_in.data_ptr() == w_out.data_ptr()


def untie_head(model: nn.Module) -> None:
    """Give a tied LM head its own copy of the weight (scales folded into it then leave the
    embeddings as they are) and record the split in the config (:func:`mark_untied`)."""
    if head_is_tied(model):
        head = model.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    mark_untied(model)


def mark_untied(model: nn.Module) -> None:
    """``tie_word_embeddings = False`` in the config (and a text sub-config, Gemma 3's), so a saved
    model's loaders (transformers, vLLM) read the head's own tensors instead of tying it back to
    the embeddings."""
    config = getattr(model, "config", None)
    if config is None:
        return
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None and get_text() is not config:
        configs.append(get_text())
    for c in configs:
        if getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False


def check_int4_group_size(group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ConfigError(f"int4 group size must be one of {INT4_GROUP_SIZES} (torch's int4 kernel), got {group_size}")


def int4_group_sizes(targets: dict[str, nn.Linear], preferred: int) -> dict[str, int]:
    """Group size per layer; falls back (with a warning) where ``preferred`` does not divide."""
    chosen, fallbacks = {}, []
    for name, linear in targets.items():
        g = int4_group_size_for(linear.in_features, linear.out_features, preferred)
        if g is None:
            raise ConfigError(
                f"int4 cannot quantize {name} ({linear.in_features} -> {linear.out_features}): the kernel "
                f"needs out_features % 16 == 0 and in_features divisible by a group size in "
                f"{INT4_GROUP_SIZES}; leave it float with skip=(..., {name!r})"
            )
        if g != preferred:
            fallbacks.append(f"{name} ({linear.in_features})")
        chosen[name] = g
    if fallbacks:
        warnings.warn(
            f"int4 group size {preferred} does not divide in_features of {len(fallbacks)} layer(s); "
            f"they use the largest smaller group size that does: {', '.join(fallbacks[:4])}"
            + (" ..." if len(fallbacks) > 4 else ""),
            stacklevel=3,
        )
    return chosen


def check_int8_shapes(targets: dict[str, nn.Linear]) -> None:
    for name, linear in targets.items():
        try:
            check_int8_shape(linear.in_features, linear.out_features)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}; leave it float with skip=(..., {name!r})") from None
