"""Weight formats: one registry entry per format (:class:`~fastdecode.formats.base.WeightFormat`).

The names a front end offers come from here, never from lists of its own. Each format
family is one file defining its entries: ``float`` (the model's own weights),
``half`` (bf16: 16-bit weights on the float GEMM), ``torch_packed`` (int8, int4, int4-gptq), ``gguf`` (q8_0, q4_0, q4_1, gguf), ``sparse``
(sparse24, sparse24-f32), ``w8a8`` (int8 per channel x int8 activations per token); they are registered
below, in the order the front ends list them.

The compression methods that are not formats of their own, AWQ and SmoothQuant
(``fastdecode.quant.awq``, ``fastdecode.quant.smoothquant``) and pruning (magnitude, Wanda,
SparseGPT: ``fastdecode.formats.sparse``), are registered beside them
(:class:`~fastdecode.formats.base.CompressionMethod`): they produce weights in a format
(q4_0 / q4_1 / int4; w8a8 / q8_0; float or ``--then``'s) and are names for ``compress --method`` only.

    from fastdecode.formats import weight_format
    fmt = weight_format("q4_0")
    layer = fmt.native_linear(weight, bias, "auto")   # the native decoder's layer
    quantize_(model, fmt.quant_config())               # the transformers module swap
"""

from __future__ import annotations

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.base import (
    COMPRESSION_METHODS,
    FLOAT_KERNELS,
    WEIGHT_FORMATS,
    CompressionMethod,
    Linear,
    NativeLayers,
    SavedLayer,
    WeightFormat,
    check_float_kernel,
    linear_weight_bytes,
    register_format,
    register_method,
)
from fastdecode.formats.float import FLOAT
from fastdecode.formats.gguf import GGUF, Q4_0, Q4_1, Q8_0
from fastdecode.formats.half import BF16
from fastdecode.formats.sparse import PRUNING, SPARSE24, SPARSE24_F32
from fastdecode.formats.torch_packed import INT4, INT4_GPTQ, INT8, INT8_GPTQ
from fastdecode.formats.w8a8 import W8A8
from fastdecode.quant.awq import AWQ_FORMATS, awq_config
from fastdecode.quant.smoothquant import SMOOTHQUANT_FORMATS, smoothquant_config

__all__ = [
    "COMPRESSION_METHODS",
    "FLOAT_KERNELS",
    "WEIGHT_FORMATS",
    "CompressionMethod",
    "Linear",
    "NativeLayers",
    "SavedLayer",
    "WeightFormat",
    "block_precision_names",
    "compress_lm_head",
    "compress_method_names",
    "draft_quant_names",
    "linear_weight_bytes",
    "make_linear",
    "quant_config_factory",
    "quant_method_names",
    "register_format",
    "register_method",
    "runnable_format",
    "saved_layer_of",
    "saved_layers",
    "weight_format",
    "weight_format_names",
]

# The registry, in the order the front ends list the names.
for _fmt in (FLOAT, BF16, INT8, INT4, INT4_GPTQ, INT8_GPTQ, Q8_0, Q4_0, Q4_1, GGUF, SPARSE24, SPARSE24_F32, W8A8):
    register_format(_fmt)

AWQ = CompressionMethod(
    name="awq",
    help="AWQ: activation-aware scales searched on calibration text, then 4-bit weights "
    "(--format q4_0 (default), q4_1 or int4; --group-size for int4)",
    quant_config=awq_config,
    formats=AWQ_FORMATS,
)
SMOOTHQUANT = CompressionMethod(
    name="smoothquant",
    help="SmoothQuant W8A8: activation outliers moved into the weights (--alpha, default 0.5), "
    "then w8a8 layers (int8 per channel x int8 per token; --format q8_0: q8_0 blocks x int8 blocks of 32)",
    quant_config=smoothquant_config,
    formats=SMOOTHQUANT_FORMATS,
    lm_head=True,  # W8A8 throughout: the float head would stream 113 of SmolLM2's 226 MB a token
)
for _method in (AWQ, SMOOTHQUANT, *PRUNING):
    register_method(_method)


def weight_format(name: str) -> WeightFormat:
    """The entry called ``name``; an unknown name is a ConfigError listing the choices."""
    return WEIGHT_FORMATS.get(name)


def runnable_format(name: str) -> WeightFormat:
    """The entry ``--weights name`` runs; a name no target runs (unknown, or a format with no
    native layer such as ``int4-gptq``) is a ConfigError listing the ``--weights`` choices."""
    fmt = WEIGHT_FORMATS.get(name) if name in WEIGHT_FORMATS else None
    if fmt is None or not fmt.runs_as_weights:
        raise ConfigError(f"unknown weight precision {name!r}; choose one of {', '.join(weight_format_names())}")
    return fmt


def weight_format_names() -> tuple[str, ...]:
    """``--weights`` choices: the numeric models a target runs."""
    return tuple(f.name for f in WEIGHT_FORMATS if f.listed and f.runs_as_weights)


def block_precision_names() -> tuple[str, ...]:
    """The ``--weights`` choices that run on the native backend only (GGUF's block formats)."""
    return tuple(f.name for f in WEIGHT_FORMATS if f.listed and f.runs_as_weights and f.native_only)


def compress_method_names() -> tuple[str, ...]:
    """``fastdecode compress --method`` choices: formats a model can be saved in, then the
    compression methods (awq, smoothquant)."""
    formats = (f.name for f in WEIGHT_FORMATS if f.listed and f.quant_config is not None and f.saved is not None)
    return (*formats, *(m.name for m in COMPRESSION_METHODS))


def compress_lm_head(name: str) -> bool:
    """Whether ``compress --method name`` quantizes the LM head by default (a method's ``lm_head``;
    a format keeps the head float: a tied head is the embeddings' storage, 113 MB on SmolLM2)."""
    return name in COMPRESSION_METHODS and COMPRESSION_METHODS.get(name).lm_head


def quant_method_names() -> tuple[str, ...]:
    """Every name ``fastdecode.quant.config_from_method`` takes (those not listed included)."""
    return (*(f.name for f in WEIGHT_FORMATS if f.quant_config is not None), *(m.name for m in COMPRESSION_METHODS))


def quant_config_factory(name: str):
    """The config factory ``config_from_method(name, ...)`` calls (a format's or a method's), or None."""
    if name in COMPRESSION_METHODS:
        return COMPRESSION_METHODS.get(name).quant_config
    return WEIGHT_FORMATS.get(name).quant_config if name in WEIGHT_FORMATS else None


def draft_quant_names() -> tuple[str, ...]:
    """``--draft-quant`` choices: how a draft model's weights are held ("none": as loaded), then
    the compression methods (awq, smoothquant), which quantize a private copy of the draft model
    on the shipped calibration text when the drafter is built."""
    return ("none", *(f.name for f in WEIGHT_FORMATS if f.listed and f is not FLOAT), *calibrated_draft_quants())


def calibrated_draft_quants() -> tuple[str, ...]:
    """The ``--draft-quant`` names that rewrite a copy of the model with a calibrated method."""
    return tuple(m.name for m in COMPRESSION_METHODS if m.drafts)


def saved_layers() -> dict[str, SavedLayer]:
    """The kinds of quantized module a saved model may hold, by their layout record's ``kind``."""
    return {f.saved.kind: f.saved for f in WEIGHT_FORMATS if f.saved is not None}


def saved_layer_of(module: nn.Module) -> SavedLayer | None:
    """The :class:`SavedLayer` ``module`` is an instance of (None for a module of no format's)."""
    return next((s for s in saved_layers().values() if isinstance(module, s.module)), None)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, float_kernel: str = "auto") -> Linear:
    """weight: [out_features, in_features]: the native layer of format ``precision``
    (its entry's ``native_linear``). ``float_kernel`` picks fastdecode's
    row-invariant kernels (``auto``, where they run) or torch's (``torch``) for
    ``float``, ``int8`` and the block formats (torch: their reference in torch ops);
    ``int4`` always runs torch's packed kernel."""
    check_float_kernel(float_kernel)
    return runnable_format(precision).native_linear(weight, bias, float_kernel)
