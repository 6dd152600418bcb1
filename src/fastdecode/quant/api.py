"""``quantize_(model, config)``: replace a model's ``nn.Linear`` layers in place.

A method is one frozen config dataclass plus one handler registered for its type
(:func:`register_quant_method`); :func:`quantize_` looks the handler up and never
branches on the method itself. Handlers receive the Linear layers to replace, by
qualified name, and swap in :mod:`fastdecode.quant.linear` modules.

The LM head is skipped by default (``skip=("lm_head",)``): it is usually tied to
the input embeddings, which must stay float, and on small models it is the layer
most sensitive to rounding. Pass ``skip=()`` to quantize it as well.
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.gguf_blocks import FORMATS
from fastdecode.quant import math as qmath
from fastdecode.quant.linear import (
    GGUFBlockLinear,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    check_int8_shape,
    int4_group_size_for,
)
from fastdecode.registry import Registry

DEFAULT_SKIP = ("lm_head",)


# ---------------------------------------------------------------- configs


@dataclass(frozen=True)
class Int8WeightOnlyConfig:
    """int8 per-output-channel symmetric weights, round-to-nearest."""

    method = "int8"

    def to_dict(self) -> dict:
        return {"method": self.method}


@dataclass(frozen=True)
class Int4WeightOnlyConfig:
    """int4 asymmetric weights in groups of ``group_size`` input columns, round-to-nearest.

    A layer whose in_features ``group_size`` does not divide gets the largest
    smaller supported group size that does, with a warning.
    """

    group_size: int = 32
    method = "int4"

    def __post_init__(self) -> None:
        _check_int4_group_size(self.group_size)

    def to_dict(self) -> dict:
        return {"method": self.method, "group_size": self.group_size}


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ (Frantar et al. 2022) with calibration data.

    Calibration comes from ``calibration_token_ids`` (sequences of ids, used as
    given, each cut to ``seq_len``), else ``calibration_texts`` (joined, tokenized
    with the tokenizer handed to :func:`quantize_`, cut into up to
    ``num_samples`` windows of ``seq_len`` tokens), else
    :func:`default_calibration_text`. ``bits=8`` is per-channel: pass
    ``group_size=None``.
    """

    bits: int = 4
    group_size: int | None = 32
    calibration_texts: tuple[str, ...] | None = None
    calibration_token_ids: tuple[tuple[int, ...], ...] | None = None
    num_samples: int = 8
    seq_len: int = 256
    percdamp: float = 0.01
    blocksize: int = 128

    def __post_init__(self) -> None:
        if self.bits == 4:
            if self.group_size is None:
                raise ConfigError("int4 GPTQ needs a group size")
            _check_int4_group_size(self.group_size)
        elif self.bits == 8:
            if self.group_size is not None:
                raise ConfigError("int8 GPTQ is per-channel: pass group_size=None")
        else:
            raise ConfigError(f"GPTQ supports bits=4 or bits=8, got {self.bits}")
        if self.num_samples < 1 or self.seq_len < 2:
            raise ConfigError(f"GPTQ needs num_samples >= 1 and seq_len >= 2, got {self.num_samples}, {self.seq_len}")
        if not 0 <= self.percdamp < 1:
            raise ConfigError(f"percdamp must be in [0, 1), got {self.percdamp}")
        if self.blocksize < 1:
            raise ConfigError(f"blocksize must be >= 1, got {self.blocksize}")
        # Lists are accepted for convenience; stored as tuples so the config stays hashable.
        if self.calibration_texts is not None:
            object.__setattr__(self, "calibration_texts", tuple(self.calibration_texts))
        if self.calibration_token_ids is not None:
            ids = tuple(tuple(int(t) for t in seq) for seq in self.calibration_token_ids)
            if not ids or not all(ids):
                raise ConfigError("calibration_token_ids must hold at least one non-empty sequence")
            object.__setattr__(self, "calibration_token_ids", ids)

    @property
    def method(self) -> str:
        return f"int{self.bits}-gptq"

    def to_dict(self) -> dict:
        """Settings for the record; the calibration data itself is summarized, not copied."""
        if self.calibration_token_ids is not None:
            source = f"{len(self.calibration_token_ids)} token-id sequences"
        elif self.calibration_texts is not None:
            source = f"{len(self.calibration_texts)} texts, {sum(map(len, self.calibration_texts))} chars"
        else:
            source = "default_calibration_text()"
        return {
            "method": self.method,
            "bits": self.bits,
            "group_size": self.group_size,
            "calibration": source,
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "percdamp": self.percdamp,
            "blocksize": self.blocksize,
        }


@dataclass(frozen=True)
class GGUFBlockConfig:
    """GGUF's block formats with ggml's rounding (``fastdecode.gguf_blocks``): ``q8_0``
    (int8 and an fp16 scale per 32 weights), ``q4_0`` (4 bits, symmetric) or ``q4_1``
    (4 bits, scale and minimum).

    The quantized layers compute what ``--weights q8_0|q4_0|q4_1`` computes on the
    native backend from the same float model, bit for bit, and the native backend
    runs them on its block kernels. Any layer shape is accepted (a row whose length
    32 does not divide is padded with zero weights).
    """

    format: str = "q4_0"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"unknown GGUF block format {self.format!r}; choose one of {', '.join(FORMATS)}")

    @property
    def method(self) -> str:
        return self.format

    def to_dict(self) -> dict:
        return {"method": self.method}


QuantConfig = Int8WeightOnlyConfig | Int4WeightOnlyConfig | GPTQConfig | GGUFBlockConfig
BLOCK_METHODS = tuple(FORMATS)  # "q8_0", "q4_0", "q4_1"


def _check_int4_group_size(group_size: int) -> None:
    if group_size not in qmath.INT4_GROUP_SIZES:
        raise ConfigError(
            f"int4 group size must be one of {qmath.INT4_GROUP_SIZES} (torch's int4 kernel), got {group_size}"
        )


def config_from_method(method: str, group_size: int | None = None, **settings) -> QuantConfig:
    """``"int8"``, ``"int4"``, ``"int4-gptq"``, ``"int8-gptq"``, ``"q8_0"``, ``"q4_0"`` or
    ``"q4_1"`` -> its config.

    ``group_size`` applies to the int4 methods (default 32); ``settings`` go to
    :class:`GPTQConfig` (calibration, num_samples, ...).
    """
    builders: dict[str, Callable[[], QuantConfig]] = {
        "int8": lambda: Int8WeightOnlyConfig(),
        "int4": lambda: Int4WeightOnlyConfig(group_size=group_size or 32),
        "int4-gptq": lambda: GPTQConfig(bits=4, group_size=group_size or 32, **settings),
        "int8-gptq": lambda: GPTQConfig(bits=8, group_size=None, **settings),
        **{fmt: (lambda fmt=fmt: GGUFBlockConfig(fmt)) for fmt in BLOCK_METHODS},
    }
    if method not in builders:
        raise ConfigError(f"unknown quantization method {method!r}; choose from {', '.join(builders)}")
    if group_size is not None and method in BLOCK_METHODS:
        raise ConfigError(f"{method} quantizes in fixed blocks of 32 weights and takes no group size (got {group_size})")
    if group_size is not None and not method.startswith("int4"):
        raise ConfigError(f"{method} is per-channel and takes no group size (got {group_size})")
    if settings and not method.endswith("-gptq"):
        raise ConfigError(f"{method} takes no settings beyond group_size (got {sorted(settings)})")
    return builders[method]()


# ---------------------------------------------------------------- registry

# handler(model, targets, config, tokenizer): replace each targets[name] in `model`.
QuantHandler = Callable[[nn.Module, dict[str, nn.Linear], object, object], None]
QUANT_HANDLERS: Registry[type, QuantHandler] = Registry("quantization config")


def register_quant_method(config_type: type) -> Callable[[QuantHandler], QuantHandler]:
    """Handler decorator: ``quantize_(model, config_type(...))`` calls it."""
    return QUANT_HANDLERS.register(config_type)


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
    handler(model, targets, config, tokenizer)
    return model


def _skipped(name: str, patterns: Iterable[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _int4_group_sizes(targets: dict[str, nn.Linear], preferred: int) -> dict[str, int]:
    """Group size per layer; falls back (with a warning) where ``preferred`` does not divide."""
    chosen, fallbacks = {}, []
    for name, linear in targets.items():
        g = int4_group_size_for(linear.in_features, linear.out_features, preferred)
        if g is None:
            raise ConfigError(
                f"int4 cannot quantize {name} ({linear.in_features} -> {linear.out_features}): the kernel "
                f"needs out_features % 16 == 0 and in_features divisible by a group size in "
                f"{qmath.INT4_GROUP_SIZES}; leave it float with skip=(..., {name!r})"
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


def _check_int8_shapes(targets: dict[str, nn.Linear]) -> None:
    for name, linear in targets.items():
        try:
            check_int8_shape(linear.in_features, linear.out_features)
        except ConfigError as e:
            raise ConfigError(f"{name}: {e}; leave it float with skip=(..., {name!r})") from None


# ---------------------------------------------------------------- RTN handlers


@register_quant_method(Int8WeightOnlyConfig)
def _quantize_int8_rtn(model, targets, config, tokenizer) -> None:
    _check_int8_shapes(targets)
    for name, linear in targets.items():
        _set_module(model, name, Int8WeightOnlyLinear.from_float(linear))


@register_quant_method(Int4WeightOnlyConfig)
def _quantize_int4_rtn(model, targets, config, tokenizer) -> None:
    group_sizes = _int4_group_sizes(targets, config.group_size)
    for name, linear in targets.items():
        _set_module(model, name, Int4WeightOnlyLinear.from_float(linear, group_sizes[name]))


@register_quant_method(GGUFBlockConfig)
def _quantize_gguf_blocks(model, targets, config, tokenizer) -> None:
    for name, linear in targets.items():
        _set_module(model, name, GGUFBlockLinear.from_float(linear, config.format))


# ---------------------------------------------------------------- GPTQ handler


class _StopForward(Exception):
    """Raised by a hook once the layers being calibrated have seen their inputs."""


@register_quant_method(GPTQConfig)
def _quantize_gptq(model, targets, config: GPTQConfig, tokenizer) -> None:
    """Sequential GPTQ, as in the paper: decoder layers are quantized one after
    another, and each layer's Hessians come from inputs produced by the already
    quantized layers before it. Within one decoder layer, every Linear sees the
    layer's float inputs (the reference implementation's default, not
    "true-sequential"). Each stage re-runs the model on the calibration samples
    only up to the end of its decoder layer, so the cost is about L/2 full
    forward passes for L layers. Linears outside the decoder layers (an included
    LM head) form a last stage with a full forward pass.
    """
    if config.bits == 8:
        _check_int8_shapes(targets)
        group_sizes = {name: None for name in targets}
    else:
        group_sizes = _int4_group_sizes(targets, config.group_size)
    samples = _calibration_samples(config, tokenizer)
    for stop_module, names in _gptq_stages(model, targets):
        hessians = {name: qmath.HessianAccumulator(targets[name].in_features) for name in names}
        handles = [
            targets[name].register_forward_pre_hook(
                lambda module, args, acc=hessians[name]: acc.add(args[0])
            )
            for name in names
        ]
        if stop_module is not None:
            handles.append(stop_module.register_forward_hook(_raise_stop))
        try:
            with torch.no_grad():
                for ids in samples:
                    try:
                        model(input_ids=ids.unsqueeze(0), use_cache=False)
                    except _StopForward:
                        pass
        finally:
            for handle in handles:
                handle.remove()
        for name in names:
            linear = targets[name]
            quantized = qmath.gptq_quantize(
                linear.weight,
                hessians[name].H,
                bits=config.bits,
                group_size=group_sizes[name],
                blocksize=config.blocksize,
                percdamp=config.percdamp,
            )
            if config.bits == 8:
                new = Int8WeightOnlyLinear.from_quantized(*quantized, bias=linear.bias)
            else:
                new = Int4WeightOnlyLinear.from_quantized(*quantized, group_sizes[name], bias=linear.bias)
            _set_module(model, name, new)


def _raise_stop(module, args, output):
    raise _StopForward


def _gptq_stages(model: nn.Module, targets: dict[str, nn.Linear]) -> list[tuple[nn.Module | None, list[str]]]:
    """(module after which to stop the forward pass, Linear names) per stage, in order.

    The decoder layers are the children of the ModuleList holding the most target
    Linears; a model without one is calibrated all at once.
    """
    best_name, best_count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            count = sum(t.startswith(name + ".") for t in targets)
            if count > best_count:
                best_name, best_count = name, count
    stages, claimed = [], set()
    if best_name is not None:
        for index, block in enumerate(model.get_submodule(best_name)):
            prefix = f"{best_name}.{index}."
            names = [t for t in targets if t.startswith(prefix)]
            if names:
                stages.append((block, names))
                claimed.update(names)
    rest = [t for t in targets if t not in claimed]
    if rest:
        stages.append((None, rest))
    return stages


def _calibration_samples(config: GPTQConfig, tokenizer) -> list[torch.Tensor]:
    """Calibration sequences, each a LongTensor [<= seq_len]."""
    if config.calibration_token_ids is not None:
        return [torch.tensor(ids[: config.seq_len], dtype=torch.long) for ids in config.calibration_token_ids]
    if tokenizer is None:
        raise ConfigError("GPTQ calibrating on text needs a tokenizer (or pass calibration_token_ids)")
    texts = config.calibration_texts or (default_calibration_text(),)
    ids = list(tokenizer("\n\n".join(texts))["input_ids"])
    if not ids:
        raise ConfigError("the calibration text tokenized to nothing")
    windows = [ids[i : i + config.seq_len] for i in range(0, len(ids), config.seq_len)]
    # A short tail window adds little signal; keep it only if it is all there is.
    full = [w for w in windows if len(w) == config.seq_len] or windows[:1]
    return [torch.tensor(w, dtype=torch.long) for w in full[: config.num_samples]]


def default_calibration_text() -> str:
    """The built-in prompt suite's prompts (prose, Q&A, code, translation, chat), ~7 KB."""
    path = importlib.resources.files("fastdecode").joinpath("data/suite.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n\n".join(json.loads(line)["prompt"] for line in lines if line.strip())


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
    return Counter(layer["format"] if layer["kind"] == "gguf_block" else layer["kind"]
                   for layer in quantized_layers(model).values())


def precision_name(layers: Counter) -> str:
    """The numeric model of layers counted by precision, most layers first: "int8+float"."""
    return "+".join(kind for kind, _ in layers.most_common())


def quantized_layers(model: nn.Module) -> dict[str, dict]:
    """Qualified name -> layout record per quantized layer: {"kind": "int8"}, {"kind": "int4",
    "group_size": ...} or {"kind": "gguf_block", "format": "q4_0", "shape": [out, in]}."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, Int8WeightOnlyLinear):
            layers[name] = {"kind": "int8"}
        elif isinstance(module, Int4WeightOnlyLinear):
            layers[name] = {"kind": "int4", "group_size": module.group_size}
        elif isinstance(module, GGUFBlockLinear):
            layers[name] = {"kind": "gguf_block", "format": module.format,
                            "shape": [module.out_features, module.in_features]}
    return layers
