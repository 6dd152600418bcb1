"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") as a compression method: :class:`GPTQConfig` and its handler.

It produces weights in the torch-packed formats (``fastdecode.formats.torch_packed``:
int4 group-wise, or int8 per-channel), calibrated on sample inputs; the column-by-column
rounding itself is pure math (``fastdecode.quant.math.gptq_quantize``).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
from dataclasses import dataclass

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.quant.handlers import (
    check_int4_group_size,
    check_int8_shapes,
    int4_group_sizes,
    register_quant_method,
    set_module,
)
from fastdecode.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from fastdecode.quant.math import HessianAccumulator, gptq_quantize
from fastdecode.util.progress import track


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
            check_int4_group_size(self.group_size)
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
        check_int8_shapes(targets)
        group_sizes = {name: None for name in targets}
    else:
        group_sizes = int4_group_sizes(targets, config.group_size)
    samples = _calibration_samples(config, tokenizer)
    for stop_module, names in track(_gptq_stages(model, targets), "gptq: decoder layers"):
        hessians = {name: HessianAccumulator(targets[name].in_features) for name in names}
        handles = [
            targets[name].register_forward_pre_hook(lambda module, args, acc=hessians[name]: acc.add(args[0]))
            for name in names
        ]
        if stop_module is not None:
            handles.append(stop_module.register_forward_hook(_raise_stop))
        try:
            with torch.no_grad():
                for ids in samples:
                    with contextlib.suppress(_StopForward):
                        model(input_ids=ids.unsqueeze(0), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        for name in names:
            linear = targets[name]
            quantized = gptq_quantize(
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
            set_module(model, name, new)


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
