"""SmoothQuant (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models") as a compression method, W8A8:
:class:`SmoothQuantConfig` and its handler.

Activations have a few channels of large magnitude (outliers) that int8 rounds badly;
weights do not. Per input channel j of a group of linears reading one input,

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

(max|X_j| over the calibration tokens, max|W_j| over the group's weight rows; alpha = 0.5
by default, the paper's) moves part of that range into the weights: X / s is folded into
the RMSNorm before the group and W * s into its weights (``fastdecode.quant.smoothing``;
exact in float). As the paper does for Llama-style decoders, the groups are q/k/v after
``input_layernorm`` and gate/up after the MLP's norm; for w8a8 also down_proj after up_proj
(llm-compressor's Llama mapping: per-token activations round the MLP's inner outliers worst;
on SmolLM2-135M, 2 windows of WikiText-2, KL to float 0.0140 -> 0.0123, perplexity 19.18 ->
19.04 against float's 18.84; alpha 0.8 was worse, 19.37); o_proj is not smoothed. A quantized
LM head (``compress`` quantizes it for SmoothQuant) is smoothed into the final norm as well.

The weights are then rounded to int8 per output channel with float32 scales and run as W8A8
(``format="w8a8"``, the default: ``fastdecode.quant.linear.W8A8Linear`` on
``kernels/w8a8.c``): each row of activations is quantized to int8 with one scale per token,
the paper's scheme, and meets the weights in one exact int32 sum over the whole row, scaled by
d_w * d_x. ``format="q8_0"`` rounds them to GGUF's q8_0 blocks instead (an fp16 scale per 32
weights), whose kernels quantize activations per block of 32 (``kernels/quant.c``). Either
way each row's result is independent of the other rows: row-invariant, and speculative
decoding against a SmoothQuant target is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdecode.errors import ConfigError
from fastdecode.quant.calibration import (
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENCES,
    CalibratedConfig,
    calibration_samples,
    collect_activation_stats,
)
from fastdecode.quant.handlers import register_quant_method, set_module, untie_head
from fastdecode.quant.linear import GGUFBlockLinear, W8A8Linear
from fastdecode.quant.smoothing import PAIRS, SmoothGroup, fold_scales, head_group, smoothing_groups

SMOOTHED = ("attn_in", "mlp_in")  # the paper's: the groups after a norm (q8_0's default)
SMOOTHED_W8A8 = ("attn_in", "mlp_in", "mlp_out")  # and down_proj after up_proj, for per-token activations
SMOOTHQUANT_FORMATS = ("w8a8", "q8_0")  # the layers it makes, the default first


@dataclass(frozen=True)
class SmoothQuantConfig(CalibratedConfig):
    """SmoothQuant W8A8 (the module docstring): migration strength ``alpha`` in [0, 1],
    ``groups`` smoothed (``fastdecode.quant.smoothing.PAIRS``; default :data:`SMOOTHED_W8A8` for
    w8a8, :data:`SMOOTHED` for q8_0), layers in ``format`` (:data:`SMOOTHQUANT_FORMATS`: w8a8, or
    q8_0 blocks).
    Calibration: up to ``num_sequences`` windows of ``seq_len`` tokens of
    ``calibration_text`` (default: the shipped calibration text), or
    ``calibration_token_ids`` as given."""

    alpha: float = 0.5
    bits: int = 8
    format: str = "w8a8"
    groups: tuple[str, ...] | None = None
    smooth_head: bool = True  # a quantized LM head smoothed too, its scales folded into the final norm
    num_sequences: int = DEFAULT_SEQUENCES
    seq_len: int = DEFAULT_SEQ_LEN
    calibration_text: str | None = None
    calibration_token_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"SmoothQuant alpha must be in [0, 1], got {self.alpha}")
        if self.bits != 8 or self.format not in SMOOTHQUANT_FORMATS:
            raise ConfigError(
                f"SmoothQuant here is W8A8 in {' or '.join(SMOOTHQUANT_FORMATS)} layers, "
                f"not bits={self.bits}, format={self.format!r}"
            )
        default = SMOOTHED_W8A8 if self.format == "w8a8" else SMOOTHED
        object.__setattr__(self, "groups", default if self.groups is None else tuple(self.groups))
        if set(self.groups) - set(PAIRS):
            raise ConfigError(f"SmoothQuant groups must be among {', '.join(PAIRS)}, got {self.groups}")
        self.freeze_calibration()

    @property
    def method(self) -> str:
        return "smoothquant"

    def to_dict(self) -> dict:
        """The settings for a saved model's record; the layers name their format (w8a8 or q8_0)."""
        return {
            "method": self.method,
            "alpha": self.alpha,
            "bits": self.bits,
            "format": self.format,
            "groups": list(self.groups),
            "smooth_head": self.smooth_head,
            "calibration": self.calibration.describe(),
        }


def smoothing_scales(abs_max_x: torch.Tensor, weight: torch.Tensor, alpha: float, floor: float = 1e-5) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha). abs_max_x: [in]; weight: [out, in] (the
    group's rows stacked) -> s [in]. Channels that never fire (or weights all zero) keep s = 1."""
    abs_max_w = weight.detach().float().abs().amax(0)
    x = abs_max_x.float().clamp(min=floor)
    w = abs_max_w.clamp(min=floor)
    s = x.pow(alpha) / w.pow(1 - alpha)
    dead = (abs_max_x <= 0) | (abs_max_w <= 0)
    return torch.where(dead, torch.ones_like(s), s.clamp(min=floor))


@register_quant_method(SmoothQuantConfig)
def _quantize_smoothquant(model, targets, config: SmoothQuantConfig, tokenizer) -> None:
    groups = [g for g in smoothing_groups(model, config.groups) if any(n in targets for n in g.names)]
    head = head_group(model) if config.smooth_head else None
    if head is not None and head.names[0] in targets:
        untie_head(model)  # only a head being smoothed: a skipped one stays the embeddings' storage
        groups.append(head)
    samples = calibration_samples(config.calibration, tokenizer)
    stats = collect_activation_stats(model, {g.names[0]: g.linears[0] for g in groups}, samples)
    for group in groups:
        fold_scales(group, _group_scales(group, stats[group.names[0]].abs_max, config.alpha))
    for name, linear in targets.items():
        if config.format == "w8a8":
            set_module(model, name, W8A8Linear.from_float(linear))
        else:
            set_module(model, name, GGUFBlockLinear.from_float(linear, config.format))


def _group_scales(group: SmoothGroup, abs_max_x: torch.Tensor, alpha: float) -> torch.Tensor:
    weight = torch.cat([linear.weight.detach().float() for linear in group.linears])
    if group.kv_repeat > 1:  # o_proj after v_proj: one scale per value channel
        abs_max_x = group.tie_heads(abs_max_x)
        weight_max = group.tie_heads(weight.abs().amax(0))
        return group.tie_heads(smoothing_scales(abs_max_x, weight_max[None], alpha))
    return smoothing_scales(abs_max_x, weight, alpha)


def smoothquant_config(group_size: int | None = None, **settings) -> SmoothQuantConfig:
    """``config_from_method("smoothquant", alpha=...)``."""
    if group_size is not None:
        raise ConfigError(
            f"smoothquant rounds weights per output channel or in q8_0 blocks and takes no group size (got {group_size})"
        )
    return SmoothQuantConfig(**settings)
