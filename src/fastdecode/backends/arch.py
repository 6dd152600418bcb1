"""The decoder layouts the native path runs, described once.

Every supported model is the same pre-norm decoder - RMSNorm -> grouped-query
attention with RoPE -> RMSNorm -> gated MLP - and differs only in what
:class:`DecoderArch` names: the Llama family (Llama, Mistral, Qwen2, SmolLM2)
as it is, and Gemma 3 with its additions (RMSNorm weights stored as w - 1, a
norm on each query and key head, norms after attention and after the MLP too,
GeGLU, scaled embeddings, a query scale of its own, and local layers with a
sliding window and their own RoPE base). The decoder reads this description;
it never asks which model it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.backends.hf import context_length_of

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GEMMA3 = ("gemma3_text",)
NATIVE_MODEL_TYPES = LLAMA_FAMILY + GEMMA3
# RoPE variants whose frequencies are fixed: the native decoder computes each table
# once for the whole cache. "dynamic" and "longrope" rescale with the longest
# position of a call, so one table over the cache's capacity would give early
# positions frequencies transformers only uses past the trained length.
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class DecoderArch:
    attn_scale: float  # multiplies q . k
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too, before the residual add
    layer_types: tuple[str, ...] | None = None  # per layer: the key of its RoPE table (None: one table)
    windows: tuple[int | None, ...] | None = None  # per layer: sliding window in positions, None = full


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_reason(config) -> str | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # flat ({"rope_type": ...}) or per layer type (Gemma 3: {"sliding_attention": {...}, ...})
    groups = [params] if "rope_type" in params or "rope_theta" in params else list(params.values())
    for group in groups:
        if not isinstance(group, dict):
            continue
        kind = group.get("rope_type", "default")
        if kind not in _ROPE_TYPES:
            return f"rope type {kind!r} is not implemented natively (supported: {', '.join(_ROPE_TYPES)})"
    return None


def decoder_arch(model) -> DecoderArch | str:
    """The layout of ``model``'s decoder, or the reason the native path cannot run it."""
    config = model.config
    kind = config.model_type
    if kind not in NATIVE_MODEL_TYPES:
        return f"architecture {kind!r} has no native decoder (supported: {', '.join(NATIVE_MODEL_TYPES)})"
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "unexpected module layout"
    reason = _rope_reason(config)
    if reason is not None:
        return reason
    if kind in GEMMA3:
        return _gemma3(config)
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < context_length_of(config):
        return "sliding-window attention is implemented natively for Gemma 3's layout only"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not implemented natively"
    return DecoderArch(attn_scale=head_dim_of(config) ** -0.5)


def _gemma3(config) -> DecoderArch | str:
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        return f"Gemma 3 activation {getattr(config, 'hidden_activation', None)!r} is not implemented natively"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"{name} is not implemented natively"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not a decoder"
    layer_types = tuple(config.layer_types)
    if set(layer_types) - {"sliding_attention", "full_attention"}:
        return f"layer types {sorted(set(layer_types))} are not implemented natively"
    windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in layer_types)
    return DecoderArch(
        attn_scale=config.query_pre_attn_scalar**-0.5,
        norm_offset=1.0,
        activation="gelu_tanh",
        embed_scale=config.hidden_size**0.5,
        qk_norm=True,
        sandwich_norms=True,
        layer_types=layer_types,
        windows=windows,
    )


def native_support(model) -> str | None:
    """None when the native decoder can run ``model``, else the reason it cannot."""
    arch = decoder_arch(model)
    return arch if isinstance(arch, str) else None
