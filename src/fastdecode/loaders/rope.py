"""RoPE inverse frequencies as transformers' ``modeling_rope_utils`` computes them, for the RoPE types
GGUF files carry: default, linear, llama3 (a Llama 3 file's rope_freqs), yarn (gpt-oss).

Why written here: the functions are transformers', but importing them imports transformers' package
(its ``__init__`` and dependency checks), over a second of a GGUF load that otherwise needs none of it.
Each function repeats transformers' operations in transformers' order and dtypes, so the tables are
the same bits (``tests/loaders/test_rope.py`` compares them with ``ROPE_INIT_FUNCTIONS``); the other
types (dynamic, longrope, ...) are transformers' own, imported where a config has one.
"""

from __future__ import annotations

import math

import torch

from fastdecode.architectures import head_dim_of


def _dim(config, rope: dict, head_dim: int | None = None) -> int:
    head_dim = head_dim_of(config) if head_dim is None else head_dim
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


def _base_inv_freq(rope: dict, dim: int) -> torch.Tensor:
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _linear(config, rope: dict, top: dict) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope, _dim(config, rope))
    inv_freq /= rope["factor"]
    return inv_freq, 1.0


def _llama3(config, rope: dict, top: dict) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope, _dim(config, rope))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config, rope: dict, top: dict) -> tuple[torch.Tensor, float]:
    base = rope["rope_theta"]
    # transformers' yarn reads head_dim without the "or" of the other types
    dim = _dim(config, rope, getattr(config, "head_dim", config.hidden_size // config.num_attention_heads))
    factor, attention_factor = rope["factor"], rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    original = rope["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / original
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if top.get("truncate", True):  # transformers reads it from the config's top table
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


_OWN = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}


def rope_inv_freq(config, rope: dict, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim * partial / 2], attention scaling) of ``rope`` (``config``'s RoPE table,
    or its ``layer_type``'s), as transformers' rotary module of ``config`` computes them."""
    kind = rope["rope_type"]
    if kind == "default":  # each transformers model's compute_default_rope_parameters
        dim = head_dim_of(config)
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if kind in _OWN:
        return _OWN[kind](config, rope, config.rope_parameters)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[kind](config, None, **kwargs)
