"""What llama.cpp's converter (``convert_hf_to_gguf.py``) writes of each dense architecture beyond the
common keys, as :class:`~fastdecode.formats.gguf_export.DecoderShape` fields, from a transformers config:
``arch_fields(config)``. Each function follows its converter class (``GraniteModel``, ``Phi3MiniModel``,
``Olmo2Model`` ...) and refuses, with one ConfigError, a model whose file llama.cpp would read back as
another (what its graph fixes where the file has no key: ``architectures/table.py``)."""

from __future__ import annotations

import math

from fastdecode.architectures.table import LLAMA_CPP_NOPE_STEP, gemma_query_scalar
from fastdecode.errors import ConfigError


def _windowed(config) -> dict:
    """OLMo 3, EXAONE 4: the window and which layers have it, as Olmo2Model and Exaone4Model write them."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return {}
    return dict(
        sliding_window=window, sliding_window_pattern=tuple(t == "sliding_attention" for t in config.layer_types)
    )


def _llama_head_dim(config) -> int:
    """Granite's and Phi-3's converters write no head_dim (llama.cpp takes hidden / heads): one that differs
    cannot be written."""
    head_dim = config.hidden_size // config.num_attention_heads
    if (getattr(config, "head_dim", None) or head_dim) != head_dim:
        raise ConfigError(
            f"{config.model_type}: llama.cpp reads head_dim = hidden / heads = {head_dim}, not {config.head_dim}"
        )
    return head_dim


def _granite(config) -> dict:
    _llama_head_dim(config)
    return dict(  # GraniteModel writes each multiplier only where it is set (not 0)
        attention_scale=config.attention_multiplier or None,
        embedding_scale=config.embedding_multiplier or None,
        residual_scale=config.residual_multiplier or None,
        logit_scale=config.logits_scaling or None,
        head_dim_keys=False,
    )


def _smollm3(config) -> dict:
    # llama.cpp reads no key for SmolLM3's NoPE layers: it fixes them at every fourth (n_no_rope_layer_step =
    # 4), and no sliding window
    every_fourth = [int((i + 1) % LLAMA_CPP_NOPE_STEP != 0) for i in range(config.num_hidden_layers)]
    if list(config.no_rope_layers) != every_fourth or getattr(config, "use_sliding_window", False):
        raise ConfigError(
            "smollm3: llama.cpp reads NoPE in every fourth layer and no sliding window; the model differs"
        )
    return {}


def _phi3(config) -> dict:
    """Phi3MiniModel's keys: the window (0: none), the original context and LongRoPE's factors."""
    _llama_head_dim(config)
    rope = getattr(config, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    fields = dict(sliding_window=getattr(config, "sliding_window", None) or 0, head_dim_keys=False)
    fields["rope_original_context"] = original or config.max_position_embeddings
    if rope.get("long_factor"):
        if rope.get("rope_type") != "longrope":
            raise ConfigError(f"phi3: rope type {rope.get('rope_type')!r} with long factors is not written here")
        scale = config.max_position_embeddings / fields["rope_original_context"]
        fields["rope_attn_factor"] = (
            math.sqrt(1 + math.log(scale) / math.log(fields["rope_original_context"])) if scale > 1.0 else 1.0
        )
        fields["longrope_factors"] = (tuple(rope["long_factor"]), tuple(rope["short_factor"]))
    return fields


def _gemma(config) -> dict:
    """Gemma 2 and 3: llama.cpp's query scale is 1 / sqrt(head_dim) (the 27B's, 1 / sqrt(hidden / heads); a GGUF
    keeps no query_pre_attn_scalar), so a model with another cannot be written."""
    n_layers, heads = config.num_hidden_layers, config.num_attention_heads
    scalar = gemma_query_scalar(config.model_type, n_layers, config.head_dim, config.hidden_size, heads)
    if config.query_pre_attn_scalar != scalar:
        raise ConfigError(
            f"{config.model_type}: llama.cpp scales queries by 1/sqrt({scalar}) for this model, not "
            f"1/sqrt(query_pre_attn_scalar={config.query_pre_attn_scalar})"
        )
    fields = dict(sliding_window=config.sliding_window, final_logit_softcapping=config.final_logit_softcapping)
    if config.model_type == "gemma2":
        return dict(fields, attn_logit_softcapping=config.attn_logit_softcapping)
    rope = getattr(config, "rope_parameters", None) or {}
    local = rope.get("sliding_attention", {}).get("rope_theta") or getattr(config, "rope_local_base_freq", None)
    return dict(fields, rope_local_theta=local)


def _mistral(config) -> dict:
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise ConfigError("mistral: llama.cpp's llama architecture has no sliding window; the model's is shorter")
    return {}


# model_type -> the DecoderShape fields of what its converter writes beyond the common keys
ARCH_FIELDS = {
    "mistral": _mistral,
    "granite": _granite,
    "smollm3": _smollm3,
    "olmo3": _windowed,
    "exaone4": _windowed,
    "phi3": _phi3,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
}


def arch_fields(config) -> dict:
    """The DecoderShape fields of ``config``'s architecture beyond the common keys ({} for none)."""
    describe = ARCH_FIELDS.get(config.model_type)
    return describe(config) if describe is not None else {}
