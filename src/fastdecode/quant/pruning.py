"""Pruning as a compression method: magnitude, Wanda and SparseGPT (:class:`PruneConfig` and
its handler), unstructured or N:M, optionally followed by a quantization (``then``).

The math is in ``fastdecode.quant.sparsity``. As built here:

* only the linears of the decoder layers are pruned (as both papers do; the LM head and
  anything outside the layers stay dense, and are quantized by ``then`` if given);
* the layers are pruned one after another, each from the inputs the already pruned layers
  before it produce (the papers' sequential setting), by GPTQ's staged forward passes
  (``fastdecode.quant.gptq``): each stage runs the calibration sequences only up to the end
  of its decoder layer, and holds statistics for that layer's linears alone (Wanda: a norm
  per input channel; SparseGPT: the [in, in] Hessian), so memory is bounded by one layer;
* calibration: ``fastdecode.quant.calibration`` (the shipped Tiny Shakespeare text, by
  default :data:`~fastdecode.quant.calibration.DEFAULT_SEQUENCES` windows of
  :data:`~fastdecode.quant.calibration.DEFAULT_SEQ_LEN` tokens; the papers use 128 x 2048
  tokens of C4); magnitude pruning needs none;
* ``then``: a quantization config (q8_0, q4_0, int8, awq, ...) applied to the pruned model.
  With SparseGPT and ``then`` q8_0 or q4_0 the rounding is joint (the paper's section 3.2):
  each column is rounded to the format as the OBS pass reaches it, a block's fp16 scale chosen
  from the block's weights when its first column is reached, and the rounding error is pushed
  onto later columns with the pruning error. Pruned weights stay exactly 0 through q8_0 and
  q4_0 (and AWQ into q4_0); asymmetric formats (int4, q4_1) store them as near-zeros.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.kernels.gguf_blocks import FORMATS, QK, BlockTensor
from fastdecode.quant.calibration import (
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENCES,
    CalibratedConfig,
    calibration_samples,
)
from fastdecode.quant.gptq import _gptq_stages, _raise_stop, _StopForward
from fastdecode.quant.handlers import QUANT_HANDLERS, register_quant_method, set_module
from fastdecode.quant.linear import GGUFBlockLinear
from fastdecode.quant.math import HessianAccumulator
from fastdecode.quant.sparsity import (
    check_pattern,
    check_sparsity,
    magnitude_score,
    parse_pattern,
    score_mask,
    sparsegpt_prune,
    wanda_score,
)
from fastdecode.util.progress import track

PRUNING_METHODS = ("magnitude", "wanda", "sparsegpt")
JOINT_FORMATS = ("q8_0", "q4_0")  # SparseGPT rounds to these inside its pass
FILLING_METHODS = ("int4-gptq", "int8-gptq")  # would write every pruned weight back


@dataclass(frozen=True)
class PruneConfig(CalibratedConfig):
    """Prune the decoder layers' linears with ``method`` (magnitude, wanda, sparsegpt) to
    ``sparsity`` (unstructured; default 0.5) or an N:M ``pattern`` ((2, 4) or "2:4"), then
    quantize with ``then`` (a quantization config, or None to keep float weights). The
    calibration options are :class:`~fastdecode.quant.calibration.CalibrationSettings`'."""

    method: str = "wanda"
    sparsity: float | None = None
    pattern: tuple[int, int] | None = None
    then: object | None = None
    joint: bool = True  # SparseGPT with then q8_0 / q4_0: round inside the pass
    num_sequences: int = DEFAULT_SEQUENCES
    seq_len: int = DEFAULT_SEQ_LEN
    calibration_text: str | None = None
    calibration_token_ids: tuple[tuple[int, ...], ...] | None = None
    percdamp: float = 0.01
    blocksize: int = 128

    def __post_init__(self) -> None:
        if self.method not in PRUNING_METHODS:
            raise ConfigError(f"unknown pruning method {self.method!r}; choose one of {', '.join(PRUNING_METHODS)}")
        pattern = parse_pattern(self.pattern) if isinstance(self.pattern, str) else self.pattern
        if pattern is not None:
            pattern = tuple(int(v) for v in pattern)
            check_pattern(*pattern)
            object.__setattr__(self, "pattern", pattern)
        if self.sparsity is not None and pattern is not None:
            raise ConfigError("give a sparsity (unstructured) or an N:M pattern, not both")
        if self.sparsity is None and pattern is None:
            object.__setattr__(self, "sparsity", 0.5)
        if self.sparsity is not None:
            check_sparsity(self.sparsity)
        if self.then is not None and type(self.then) not in QUANT_HANDLERS:
            raise ConfigError(f"then must be a quantization config, got {type(self.then).__name__}")
        if getattr(self.then, "method", None) in FILLING_METHODS or isinstance(self.then, PruneConfig):
            raise ConfigError(
                f"pruning then {self.then.method} would fill the pruned weights back in; "
                "use --method sparsegpt --then q8_0|q4_0 (pruning and rounding jointly)"
            )
        if not 0 <= self.percdamp < 1 or self.blocksize < 1 or self.blocksize % QK:
            raise ConfigError(f"percdamp must be in [0, 1) and blocksize a multiple of {QK}")
        self.freeze_calibration()

    @property
    def format(self) -> str:
        """The format the layers come out in ("float" without ``then``)."""
        if self.then is None:
            return "float"
        return getattr(self.then, "format", None) or self.then.method

    @property
    def joint_format(self) -> str | None:
        """The block format SparseGPT rounds to inside its pass, or None."""
        fmt = getattr(self.then, "format", None)
        if self.method == "sparsegpt" and self.joint and fmt in JOINT_FORMATS and self.then.method == fmt:
            return fmt
        return None

    def describe(self) -> str:
        shape = f"{self.pattern[0]}:{self.pattern[1]}" if self.pattern else f"{self.sparsity:.0%} unstructured"
        return f"{self.method} {shape}" + (f" then {self.format}" if self.then is not None else "")

    def to_dict(self) -> dict:
        """The settings for a saved model's record."""
        record = {
            "method": self.method,
            "sparsity": self.sparsity,
            "pattern": None if self.pattern is None else f"{self.pattern[0]}:{self.pattern[1]}",
            "then": None if self.then is None else self.then.to_dict(),
            "joint": self.joint_format is not None,
        }
        if self.method != "magnitude":
            record["calibration"] = self.calibration.describe()
        if self.method == "sparsegpt":
            record.update(percdamp=self.percdamp, blocksize=self.blocksize)
        return record


# ---------------------------------------------------------------- joint rounding (SparseGPT then q8_0 / q4_0)


class BlockRounding:
    """ggml's q8_0 / q4_0 rounding one column at a time (``gguf_blocks.BlockTensor.quantize``'s
    formulas): a block's scale is chosen from the block's weights as they stand when its first
    column is reached, and a later column the pass has grown is clamped to the format's range.
    :meth:`block_tensor` gives the blocks built from the codes chosen, never rounded again."""

    def __init__(self, fmt: str, out_features: int, in_features: int) -> None:
        if fmt not in JOINT_FORMATS:
            raise ConfigError(f"joint rounding takes {', '.join(JOINT_FORMATS)}, not {fmt!r}")
        self.format, self.in_features = fmt, in_features
        nb = -(-in_features // QK)
        self.d = torch.zeros(out_features, nb)  # float32, as ggml computes it (stored fp16)
        pad_code = 0 if fmt == "q8_0" else 8  # the code of a zero weight
        self.codes = torch.full((out_features, nb * QK), pad_code, dtype=torch.int16)

    def __call__(self, q_col: torch.Tensor, upcoming: torch.Tensor, col: int) -> torch.Tensor:
        b = col // QK
        if col % QK == 0:
            x = upcoming[:, :QK].clone()
            x[:, 0] = q_col
            if self.format == "q8_0":
                self.d[:, b] = x.abs().amax(1) / 127
            else:
                self.d[:, b] = x.gather(1, x.abs().argmax(1, keepdim=True))[:, 0] / -8
        d = self.d[:, b]
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        d16 = d.half().float()
        if self.format == "q8_0":
            a = q_col * inverse
            code = (torch.sign(a) * torch.floor(a.abs() + 0.5)).clamp(-127, 127)  # roundf: halves away from zero
            value = code * d16
        else:
            code = torch.trunc(q_col * inverse + 8.5).clamp(0, 15)
            value = (code - 8) * d16
        self.codes[:, col] = code.to(torch.int16)
        return value

    def block_tensor(self) -> BlockTensor:
        rows = self.codes.shape[0]
        q = self.codes.view(rows, -1, QK)
        if self.format == "q8_0":
            quants = q.to(torch.int8).view(torch.uint8)
        else:
            u = q.to(torch.uint8)
            quants = u[..., :16] | (u[..., 16:] << 4)
        scale = self.d.to(torch.float16)[..., None].view(torch.uint8)
        blocks = torch.cat([scale, quants], dim=-1).reshape(rows, -1)
        return BlockTensor(FORMATS[self.format], np.ascontiguousarray(blocks.numpy()), self.in_features)


# ---------------------------------------------------------------- the handler


class _ColumnNorms:
    """Running sum of x_j^2 per input channel: ||X_j||_2 = sqrt of it."""

    def __init__(self, in_features: int) -> None:
        self.sq = torch.zeros(in_features, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        self.sq += x.detach().reshape(-1, x.shape[-1]).double().pow(2).sum(0)

    @property
    def norms(self) -> torch.Tensor:  # [in]
        return self.sq.sqrt().float()


def _collect(model: nn.Module, linears: dict[str, nn.Linear], stop: nn.Module, samples, method: str) -> dict:
    """Each of ``linears``' input statistics (Wanda: channel norms; SparseGPT: the Hessian), from
    the calibration sequences run up to the end of the decoder layer ``stop``."""
    make = _ColumnNorms if method == "wanda" else HessianAccumulator
    stats = {name: make(linear.in_features) for name, linear in linears.items()}
    handles = [
        linear.register_forward_pre_hook(lambda module, args, acc=stats[name]: acc.add(args[0]))
        for name, linear in linears.items()
    ]
    handles.append(stop.register_forward_hook(_raise_stop))
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in samples:
                with contextlib.suppress(_StopForward):
                    model(input_ids=ids.unsqueeze(0).to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats


def _prune_linear(model: nn.Module, name: str, linear: nn.Linear, stat, config: PruneConfig) -> bool:
    """Prune one linear in place (or, jointly rounded, replace it); True if it was replaced."""
    weight = linear.weight
    with torch.no_grad():
        if config.method == "sparsegpt":
            joint = config.joint_format
            rounding = None if joint is None else BlockRounding(joint, linear.out_features, linear.in_features)
            new = sparsegpt_prune(
                weight,
                stat.H,
                sparsity=config.sparsity,
                pattern=config.pattern,
                blocksize=config.blocksize,
                percdamp=config.percdamp,
                rounding=rounding,
            )
            if rounding is not None:
                set_module(model, name, GGUFBlockLinear.from_block_tensor(rounding.block_tensor(), linear.bias))
                return True
            weight.copy_(new.to(weight.dtype))
            return False
        score = magnitude_score(weight) if config.method == "magnitude" else wanda_score(weight, stat.norms)
        # magnitude compares over the layer (the papers' baseline), Wanda within each output row
        keep = score_mask(score, config.sparsity, config.pattern, per_row=config.method == "wanda")
        weight.mul_(keep.to(weight.dtype))
    return False


@register_quant_method(PruneConfig)
def _prune(model: nn.Module, targets: dict[str, nn.Linear], config: PruneConfig, tokenizer) -> None:
    """Prune the decoder layers one after another (the module docstring), then apply ``then``."""
    stages = [(stop, names) for stop, names in _gptq_stages(model, targets) if stop is not None]
    if not stages:
        raise ConfigError("pruning found no decoder layers holding the linears to prune")
    samples = None if config.method == "magnitude" else calibration_samples(config.calibration, tokenizer)
    replaced = set()
    for stop, names in track(stages, f"{config.method}: decoder layers"):
        stats = {} if samples is None else _collect(model, {n: targets[n] for n in names}, stop, samples, config.method)
        for name in names:
            if _prune_linear(model, name, targets[name], stats.get(name), config):
                replaced.add(name)
        del stats
    rest = {name: linear for name, linear in targets.items() if name not in replaced}
    if config.then is not None and rest:
        QUANT_HANDLERS.get(type(config.then))(model, rest, config.then, tokenizer)


def zero_fraction(model: nn.Module) -> float:
    """The fraction of the decoder layers' linear weights that are exactly 0 (float, or the values
    a quantized module multiplies by), for a report."""
    zeros = total = 0
    for name, module in model.named_modules():
        if ".layers." not in f".{name}":
            continue
        if isinstance(module, nn.Linear):
            w = module.weight
        elif hasattr(module, "dequantize"):  # fastdecode.quant.linear's modules
            w = module.dequantize()
        else:
            continue
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / total if total else 0.0
