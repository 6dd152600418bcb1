"""AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration") as a compression method: :class:`AWQConfig` and its handler.

The few weight channels that meet large activations matter most; scaling them up before
rounding (and the activations down by as much, folded into the operation before:
``fastdecode.quant.smoothing``) protects them without mixed precision. As built here:

1. Statistics: the float model runs over the calibration sequences
   (``fastdecode.quant.calibration``); for each group of linears that read one input
   (per decoder layer: q/k/v, o, gate/up, down) it records mean |X_j| per input channel
   and keeps up to ``max_rows`` tokens of X.
2. Scale search, per group: s = mean|X|^alpha, normalized so max(s) * min(s) = 1, for
   alpha in {0, 1/grid, ..., 1}; the alpha kept minimizes the group's output error on the
   kept tokens, mean((A(X / s) Q(W * s)^T - X W^T)^2) over the group's linears stacked, Q
   the output format's rounding and A its activation rounding (q4_0 / q4_1 run with
   activations in 8-bit blocks; int4 with float ones). alpha = 0 is s = 1, plain
   round-to-nearest, so the search is never worse than RTN on this error. For o_proj
   after v_proj the statistic is first averaged over the query heads sharing a kv head
   (grouped-query attention: one scale per value channel).
3. The scales are folded (``smoothing.fold_scales``): exact in float.
4. Clip search (``clip=True``), per linear but q_proj and k_proj (as the reference, whose
   attention scores are most sensitive): for each output row and block of
   ``group_size`` inputs, the weights clamped to +-max|w| * (1 - i / clip_grid) for
   i < clip_grid * max_shrink; the clamp kept minimizes that block's output error on the
   kept tokens (after the fold). Clamping changes rounding only, not the float function
   the fold keeps.
5. Quantization to the output format: GGUF's ``q4_0`` or ``q4_1`` blocks (run on
   fastdecode's integer dot products, saved as ``GGUFBlockLinear``), or ``int4`` groups
   (torch's packed kernel, ``Int4WeightOnlyLinear``).

The reference calibrates on 128 sequences of 512 tokens of the Pile; the default here is
fewer (``fastdecode.quant.calibration.DEFAULT_SEQUENCES``) of the shipped calibration text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.kernels.gguf_blocks import QK
from fastdecode.kernels.quant import quantize_rows_reference
from fastdecode.quant.calibration import (
    DEFAULT_MAX_ROWS,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENCES,
    CalibratedConfig,
    calibration_samples,
    collect_activation_stats,
)
from fastdecode.quant.handlers import check_int4_group_size, int4_group_sizes, register_quant_method, set_module
from fastdecode.quant.linear import GGUFBlockLinear, Int4WeightOnlyLinear
from fastdecode.quant.math import dequantize_int4_groupwise, quantize_int4_groupwise
from fastdecode.quant.smoothing import SmoothGroup, fold_scales, smoothing_groups
from fastdecode.util.progress import track

AWQ_FORMATS = ("q4_0", "q4_1", "int4")
NO_CLIP = ("q_proj", "k_proj")  # the reference leaves these unclipped


@dataclass(frozen=True)
class AWQConfig(CalibratedConfig):
    """AWQ (the module docstring gives the algorithm) producing 4-bit weights in ``format``:
    ``q4_0`` / ``q4_1`` (GGUF blocks of 32: ``group_size`` must be 32) or ``int4``
    (torch's packed groups of ``group_size`` in 32, 64, 128, 256). Calibration: up to
    ``num_sequences`` windows of ``seq_len`` tokens of ``calibration_text`` (default: the
    shipped calibration text, tokenized by the tokenizer handed to ``quantize_``), or
    ``calibration_token_ids`` as given."""

    bits: int = 4
    group_size: int = 32
    format: str = "q4_0"
    grid: int = 20  # alpha in {0, 1/grid, ..., 1}
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5  # clamp to no less than (1 - max_shrink) of a block's max |w|
    num_sequences: int = DEFAULT_SEQUENCES
    seq_len: int = DEFAULT_SEQ_LEN
    max_rows: int = DEFAULT_MAX_ROWS  # tokens of each group's input kept for the searches
    calibration_text: str | None = None
    calibration_token_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ConfigError(f"AWQ here produces 4-bit weights (q4_0, q4_1, int4), not bits={self.bits}")
        if self.format not in AWQ_FORMATS:
            raise ConfigError(f"AWQ output format must be one of {', '.join(AWQ_FORMATS)}, got {self.format!r}")
        if self.format == "int4":
            check_int4_group_size(self.group_size)
        elif self.group_size != QK:
            raise ConfigError(f"{self.format} quantizes in blocks of {QK} weights: group_size must be {QK}")
        if self.grid < 1 or self.clip_grid < 1 or not 0 <= self.max_shrink < 1 or self.max_rows < 1:
            raise ConfigError("AWQ needs grid >= 1, clip_grid >= 1, 0 <= max_shrink < 1 and max_rows >= 1")
        self.freeze_calibration()

    @property
    def method(self) -> str:
        return "awq"

    def to_dict(self) -> dict:
        """The settings for a saved model's record; the layers name their format (q4_0, int4)."""
        return {
            "method": self.method,
            "bits": self.bits,
            "format": self.format,
            "group_size": self.group_size,
            "grid": self.grid,
            "clip": self.clip,
            "clip_grid": self.clip_grid,
            "max_shrink": self.max_shrink,
            "max_rows": self.max_rows,
            "calibration": self.calibration.describe(),
        }


def awq_config(group_size: int | None = None, **settings) -> AWQConfig:
    """``config_from_method("awq", group_size=..., format=..., bits=...)``."""
    return AWQConfig(group_size=group_size or QK, **settings)


# ---------------------------------------------------------------- rounding as the output format runs it


class Rounding:
    """The output format's weight rounding Q and activation rounding A, as float tensors."""

    def __init__(self, fmt: str, group_size: int) -> None:
        self.format, self.group_size = fmt, group_size

    def weights(self, w: torch.Tensor) -> torch.Tensor:  # [out, in] -> its dequantized rounding
        if self.format == "int4":
            q, scales, zeros = quantize_int4_groupwise(w, self.group_size)
            return dequantize_int4_groupwise(q, scales, zeros, self.group_size)
        return fake_quantize_blocks(w, self.format)

    def activations(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, in] -> what the kernel multiplies
        if self.format == "int4":
            return x
        q, d = quantize_rows_reference(x)[:2]  # 8-bit blocks of 32, float32 scales
        return (q.float() * d[..., None]).reshape(x.shape[0], -1)[:, : x.shape[1]]


def fake_quantize_blocks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``BlockTensor.quantize(w, fmt).dequantize()`` for q4_0 / q4_1 (ggml's rounding, fp16
    scales) in float tensors, without packing the bytes: [out, in] -> [out, in]."""
    rows, cols = w.shape
    nb = -(-cols // QK)
    x = torch.nn.functional.pad(w.detach().float(), (0, nb * QK - cols)).view(rows, nb, QK)
    if fmt == "q4_0":
        extreme = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the signed value of largest magnitude
        d = extreme / -8
        q = torch.trunc(x * _inverse(d) + 8.5).clamp_(0, 15)
        out = (q - 8) * d.half().float()
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp_(0, 15)
        out = q * d.half().float() + lo.half().float()
    return out.reshape(rows, nb * QK)[:, :cols]


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def group_error(x: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, rounding: Rounding) -> float:
    """mean((A(x / s) Q(weight * s)^T - x weight^T)^2). x: [tokens, in]; weight: [out, in]; s: [in]."""
    reference = x @ weight.T
    approx = rounding.activations(x / s) @ rounding.weights(weight * s).T
    return float((approx - reference).pow(2).mean())


def search_scales(
    x: torch.Tensor, weight: torch.Tensor, mean_abs: torch.Tensor, grid: int, rounding: Rounding
) -> tuple[torch.Tensor, float, list[float]]:
    """AWQ's grid search: (best s [in], its alpha, the error at each alpha of the grid).
    mean_abs: [in] mean |x_j| over the calibration tokens (tied across heads where it must be)."""
    base = mean_abs.float().clamp(min=1e-4)
    best_s, best_alpha, best_err, errors = torch.ones_like(base), 0.0, float("inf"), []
    for step in range(grid + 1):
        alpha = step / grid
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = group_error(x, weight, s, rounding)
        errors.append(err)
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha, errors


def search_clip(x: torch.Tensor, weight: torch.Tensor, config: AWQConfig, rounding: Rounding) -> torch.Tensor:
    """AWQ's clip search: the clamp (max |w| kept) per output row and block of ``group_size``
    inputs, [out, in / group_size], minimizing each block's output error on ``x`` [tokens, in]."""
    g = rounding.group_size
    out_features, in_features = weight.shape
    if in_features % g:
        raise ConfigError(f"clip search needs in_features divisible by {g}, got {in_features}")
    xb = x.view(x.shape[0], -1, g)  # [tokens, blocks, g]
    wb = weight.view(out_features, -1, g)
    full = wb.abs().amax(-1)  # [out, blocks]
    best_max, best_err = full.clone(), torch.full_like(full, float("inf"))
    for i in range(int(config.max_shrink * config.clip_grid)):
        max_val = full * (1 - i / config.clip_grid)
        clamped = torch.maximum(torch.minimum(wb, max_val[..., None]), -max_val[..., None])
        delta = rounding.weights(clamped.reshape(out_features, in_features)).view_as(wb) - wb
        err = _block_output_error(xb, delta)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def _block_output_error(xb: torch.Tensor, delta: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """mean over tokens of (x_block . delta_block)^2 per (row, block). xb: [tokens, blocks, g];
    delta: [out, blocks, g] -> [out, blocks]; output rows a chunk at a time to bound memory."""
    parts = []
    for start in range(0, delta.shape[0], chunk):
        partial = torch.einsum("nbg,obg->obn", xb, delta[start : start + chunk])  # [chunk, blocks, tokens]
        parts.append(partial.pow(2).mean(-1))
    return torch.cat(parts)


def apply_clip(linear: nn.Linear, max_val: torch.Tensor, group_size: int) -> None:
    """Clamp ``linear``'s weight to +-max_val per (row, block) in place. max_val: [out, in / group_size]."""
    with torch.no_grad():
        w = linear.weight.view(linear.out_features, -1, group_size)
        bound = max_val.to(w.dtype)[..., None]
        w.copy_(torch.maximum(torch.minimum(w, bound), -bound))


# ---------------------------------------------------------------- the handler


@register_quant_method(AWQConfig)
def _quantize_awq(model, targets, config: AWQConfig, tokenizer) -> None:
    """Scale search on every group, fold, clip search, quantize (the module docstring)."""
    group_sizes = int4_group_sizes(targets, config.group_size) if config.format == "int4" else {}
    groups = [g for g in smoothing_groups(model) if any(n in targets for n in g.names)]
    heads = {g.names[0]: g for g in groups}
    samples = calibration_samples(config.calibration, tokenizer)
    stats = collect_activation_stats(
        model,
        {name: g.linears[0] for name, g in heads.items()},
        samples,
        keep_rows=tuple(heads),
        max_rows=config.max_rows,
    )
    rows = {}  # linear name -> its kept input tokens after the fold
    for group in track(groups, "awq: scale search"):
        x = stats[group.names[0]].inputs()
        s = _group_scales(group, x, stats[group.names[0]].abs_mean, targets, config)
        fold_scales(group, s)
        rows.update(dict.fromkeys(group.names, x / s))
    del stats
    for name, linear in targets.items():
        g = group_sizes.get(name, config.group_size)
        if config.clip and name in rows and name.rsplit(".", 1)[-1] not in NO_CLIP and linear.in_features % g == 0:
            apply_clip(linear, search_clip(rows[name], linear.weight.float(), config, Rounding(config.format, g)), g)
        if config.format == "int4":
            new = Int4WeightOnlyLinear.from_float(linear, g)
        else:
            new = GGUFBlockLinear.from_float(linear, config.format)
        set_module(model, name, new)


def _group_scales(
    group: SmoothGroup, x: torch.Tensor, mean_abs: torch.Tensor, targets: dict, config: AWQConfig
) -> torch.Tensor:
    """The searched s for ``group``, from the linears of it that are quantized."""
    linears = [linear for name, linear in zip(group.names, group.linears, strict=True) if name in targets]
    weight = torch.cat([linear.weight.detach().float() for linear in linears])  # [sum of out, in]
    group_size = config.group_size
    if config.format == "int4" and group.in_features % group_size:
        return torch.ones(group.in_features)  # the fallback group size is chosen per layer: leave as RTN
    s, _, _ = search_scales(x, weight, group.tie_heads(mean_abs), config.grid, Rounding(config.format, group_size))
    return s
