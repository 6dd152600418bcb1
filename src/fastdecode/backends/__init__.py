"""Targets: the model the decode loop verifies with, behind one small interface.

``make_target(model, backend, weights)`` is the one place a backend is chosen:
``auto`` takes the native decoder when it supports the architecture and the
transformers path otherwise. ``weights="auto"`` (the default) runs a model the way it is held
(:func:`resolve_weights`): a GGUF skeleton still in its file on its own blocks (``gguf``) on the
native decoder, anything else as float. ``float_kernel`` picks the native path's float
GEMM (``linear.make_float_linear``); the transformers path always runs torch's.
The GGUF block formats (``weights`` ``q8_0``, ``q4_0``, ``q4_1``, ``gguf``) run on the
native decoder only; the target's ``weights`` names the numeric model it runs. With the
``tokenizer``, a KV cache whose keys are rotated 4-bit blocks (q4_0) stores them with an affine
calibrated on the shipped calibration text (``fastdecode.kv.calibration``); without it, as they are.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch

from fastdecode.backends.base import Executor, PagedSequence, SequenceModel
from fastdecode.backends.hf import HFTarget
from fastdecode.backends.linear import BLOCK_PRECISIONS, FLOAT_KERNELS, WEIGHT_PRECISIONS
from fastdecode.backends.native import KV_CACHE_DTYPES, NativeTarget, native_support
from fastdecode.errors import ConfigError
from fastdecode.formats import runnable_format
from fastdecode.formats.base import check_float_kernel
from fastdecode.kernels.kv_formats import parse_kv_cache_dtype
from fastdecode.kv.calibration import calibration_ids
from fastdecode.loaders.gguf_model import float_cost, is_lazy, materialize, model_dtype
from fastdecode.quant.api import config_from_method, precision_name, quantize_, saved_precisions

BACKENDS = ("auto", "native", "hf")


AUTO_WEIGHTS = "auto"  # the weights a model is held in: resolve_weights


def resolve_weights(model, backend: str, weights: str = AUTO_WEIGHTS) -> str:
    """The weight format ``weights`` names for ``model`` on ``backend`` (``native`` or ``hf``, resolved):
    ``auto`` is ``gguf`` - the file's own blocks, at the size of the file - for a GGUF file's skeleton
    (``load_model`` of a ``.gguf``, its weights still in the file) on the native decoder, and ``float``
    for anything else (a float model already built, a model directory, the transformers backend).
    Any other name is returned as it is."""
    if weights != AUTO_WEIGHTS:
        return weights
    in_gguf = is_lazy(model) and getattr(model.config, "fastdecode_gguf_file", None) is not None
    return "gguf" if backend == "native" and in_gguf else "float"


def make_target(
    model,
    backend: str = "auto",
    weights: str = AUTO_WEIGHTS,
    float_kernel: str = "auto",
    kv_cache_dtype: str = "auto",
    tokenizer=None,
) -> Executor:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if weights != AUTO_WEIGHTS:
        runnable_format(weights)  # an unknown name is a ConfigError listing the --weights choices
    check_float_kernel(float_kernel)
    if backend == "auto":
        backend = "native" if native_support(model) is None else "hf"
    weights = resolve_weights(model, backend, weights)
    fmt = runnable_format(weights)
    float_note = None
    if is_lazy(model):  # a GGUF skeleton: float weights are made from its values where they are needed
        why = native_support(model)
        if backend == "native" and why is not None:
            raise ConfigError(f"--backend native cannot run this model: {why}; {float_cost(model)}")
        if not (backend == "native" and weights in BLOCK_PRECISIONS):  # the block formats read the file layer by layer
            float_note = float_cost(model) if why is not None else None
            materialize(model)
    if backend == "hf" and fmt.native_only:
        why = native_support(model)
        raise ConfigError(
            f"--weights {weights} (GGUF block formats) runs on the native backend only"
            + (f", which cannot run this model: {why}" if why else ": use --backend native or auto")
        )
    if backend == "hf" and kv_cache_dtype != "auto":
        raise ConfigError(
            f"--kv-cache-dtype {kv_cache_dtype} needs the native backend (transformers keeps its own cache in "
            "the model's dtype)"
        )
    if backend == "native":
        calibration = _kv_calibration(model, kv_cache_dtype, tokenizer)
        return NativeTarget(
            model, weights=weights, float_kernel=float_kernel, kv_cache_dtype=kv_cache_dtype, kv_calibration=calibration
        )
    if weights != "float":
        # The transformers path runs low-bit weights by swapping Linear modules
        # for fastdecode's packed-kernel ones - on a private copy, so the
        # caller's model stays the float model it was.
        model = copy.deepcopy(model)
        quantize_(model, config_from_method(weights), skip=())  # skip=(): the LM head too, as on the native path
    target = HFTarget(model)
    target.kernel_note = float_note
    # The numeric model by layers, most first: a model saved low-bit (fastdecode quantize) is low-bit
    # whatever --weights says, and speculation on this backend is refused for it (_check_lossless_target).
    kinds = saved_precisions(model) + Counter({weights: sum(type(m) is torch.nn.Linear for m in model.modules())})
    target.weights = precision_name(kinds) or weights
    return target


def _kv_calibration(model, kv_cache_dtype: str, tokenizer) -> list[int] | None:
    """The calibration text's token ids where the cache's keys are rotated (``fastdecode.kv.calibration``), else None."""
    if tokenizer is None:
        return None
    try:
        keys, _ = parse_kv_cache_dtype(kv_cache_dtype, model_dtype(model))
    except ValueError:
        return None  # NativeTarget says why
    return calibration_ids(tokenizer) if keys.rotated else None


__all__ = [
    "BACKENDS",
    "FLOAT_KERNELS",
    "KV_CACHE_DTYPES",
    "Executor",
    "PagedSequence",
    "SequenceModel",
    "HFTarget",
    "NativeTarget",
    "make_target",
    "native_support",
    "resolve_weights",
    "AUTO_WEIGHTS",
    "BLOCK_PRECISIONS",
    "WEIGHT_PRECISIONS",
]
