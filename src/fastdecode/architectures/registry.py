"""The architectures the native decoder runs: one :class:`Architecture` entry each, a function
from its transformers config to its :class:`~fastdecode.architectures.description.DecoderArch`
that refuses (:class:`Unsupported`) what it does not describe."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from fastdecode.architectures.description import (
    GPT_OSS_PARTS,
    LLAMA_PARTS,
    NOPE,
    POST_NORM_PARTS,
    QK_NORM_PARTS,
    SANDWICH_PARTS,
    DecoderArch,
    Experts,
    LayerParts,
    Unsupported,
    context_length_of,
    head_dim_of,
)

# RoPE variants whose frequencies are fixed: the native decoder computes each table once for the
# whole cache. "dynamic" rescales with the longest position of a call, so one table over the
# cache's capacity would give early positions frequencies transformers only uses past the trained
# length; "longrope" likewise past its original length, so it runs with the context cut there.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# transformers' activation names -> the gated MLP's (kernels/abi.py's GLU_ACTIVATIONS)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Architecture:
    """One registry entry: a transformers ``model_type`` the native decoder runs."""

    model_type: str
    describe: Callable[[object], DecoderArch]  # config -> its description; raises Unsupported
    # llama.cpp's name for it (gguf-py's MODEL_ARCH_NAMES, the GGUF file's general.architecture); None: none gguf-py knows
    gguf_arch: str | None
    example: str  # a model people run of this type (the README's table)


def _rope_groups(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # flat ({"rope_type": ...}) or per layer type (Gemma 3: {"sliding_attention": {...}, ...})
    groups = [params] if "rope_type" in params or "rope_theta" in params else list(params.values())
    return [g for g in groups if isinstance(g, dict)]


def _rope_context(config, longrope: bool = False) -> int | None:
    """The context the native RoPE tables are exact for: with ``longrope`` (Phi-3's checkpoints ship
    with it) LongRoPE's original length, where its short factors serve; else None (any). A RoPE it
    does not describe is Unsupported."""
    limit = None
    for group in _rope_groups(config):
        kind = group.get("rope_type", "default")
        if group.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
            raise Unsupported("partial rotary embeddings (partial_rotary_factor < 1) are not implemented natively")
        if kind == "longrope" and longrope and group.get("original_max_position_embeddings"):
            # short factors below the original length, the same table transformers uses there
            limit = int(group["original_max_position_embeddings"])
        elif kind not in _ROPE_TYPES:
            supported = ", ".join((*_ROPE_TYPES, "longrope (Phi-3)"))
            raise Unsupported(f"rope type {kind!r} is not implemented natively (supported: {supported})")
    return limit


def _activation(config, attr: str = "hidden_act") -> str:
    name = getattr(config, attr, None)
    if name not in _ACTIVATIONS:
        raise Unsupported(f"activation {name!r} is not implemented natively (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _no_short_window(config) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < context_length_of(config):
        raise Unsupported(
            "sliding-window attention is implemented natively for Gemma 2 and 3, OLMo 3, EXAONE 4, Phi-3 and SmolLM3"
        )


def _layer_windows(config, layer_types) -> tuple[int | None, ...]:
    """Per layer: ``config.sliding_window`` for a "sliding_attention" layer, None for a full one."""
    if set(layer_types) - {"sliding_attention", "full_attention"}:
        raise Unsupported(f"layer types {sorted(set(layer_types))} are not implemented natively")
    return tuple(config.sliding_window if t == "sliding_attention" else None for t in layer_types)


def _llama(config, **fields) -> DecoderArch:
    """The Llama layout (Llama, Mistral, Qwen2, SmolLM2 ...), with ``fields`` of the architectures
    that differ from it only there."""
    _no_short_window(config)
    return DecoderArch(
        attn_scale=head_dim_of(config) ** -0.5,
        activation=_activation(config),
        context_limit=_rope_context(config),
        **fields,
    )


def _qwen3(config) -> DecoderArch:
    return _llama(config, parts=QK_NORM_PARTS, qk_norm="head")


def _olmo2(config) -> DecoderArch:
    # norms after attention and the MLP only; q and k normalised over the whole projection
    return _llama(config, parts=POST_NORM_PARTS, qk_norm="proj", norm_in_float32=True)


def _olmo3(config) -> DecoderArch:
    # OLMo 2's layer; sliding-window layers with a RoPE of their own (its rotary module takes the layer type)
    layer_types = tuple(config.layer_types)
    return DecoderArch(
        attn_scale=head_dim_of(config) ** -0.5,
        parts=POST_NORM_PARTS,
        qk_norm="proj",
        norm_in_float32=True,
        activation=_activation(config),
        rope=layer_types,
        windows=_layer_windows(config, layer_types),
        context_limit=_rope_context(config),
    )


def _exaone4(config) -> DecoderArch:
    # post norms, q and k norms per head; with a sliding window, local layers have RoPE and global ones none
    hybrid = config.sliding_window is not None
    layer_types = tuple(config.layer_types)
    return DecoderArch(
        attn_scale=head_dim_of(config) ** -0.5,
        parts=POST_NORM_PARTS,
        qk_norm="head",
        activation=_activation(config),
        rope=tuple(NOPE if hybrid and t != "sliding_attention" else None for t in layer_types),
        windows=_layer_windows(config, layer_types) if hybrid else None,
        context_limit=_rope_context(config),
    )


def _granite(config) -> DecoderArch:
    _no_short_window(config)
    return DecoderArch(
        attn_scale=config.attention_multiplier,
        activation=_activation(config),
        embed_scale=config.embedding_multiplier,
        residual_scale=config.residual_multiplier,
        logit_divisor=config.logits_scaling,
        context_limit=_rope_context(config),
    )


def _smollm3(config) -> DecoderArch:
    # no_rope_layers[i] == 1: layer i has RoPE; 0: NoPE (every fourth layer by default)
    uses_rope = list(config.no_rope_layers)
    windows = _layer_windows(config, config.layer_types) if config.use_sliding_window else None
    return DecoderArch(
        attn_scale=head_dim_of(config) ** -0.5,
        activation=_activation(config),
        rope=tuple(None if r else NOPE for r in uses_rope),
        windows=windows,
        context_limit=_rope_context(config),
    )


def _phi3(config) -> DecoderArch:
    parts = LayerParts(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))
    window = getattr(config, "sliding_window", None)  # every layer's, when set
    return DecoderArch(
        attn_scale=head_dim_of(config) ** -0.5,
        parts=parts,
        activation=_activation(config),
        windows=(window,) * config.num_hidden_layers if window else None,
        context_limit=_rope_context(config, longrope=True),
    )


def _gemma2(config) -> DecoderArch:
    layer_types = tuple(config.layer_types)
    return DecoderArch(
        attn_scale=config.query_pre_attn_scalar**-0.5,
        parts=dataclasses.replace(SANDWICH_PARTS, q_norm=None, k_norm=None),
        norm_offset=1.0,
        norm_in_float32=True,
        activation=_activation(config, "hidden_activation"),
        embed_scale=config.hidden_size**0.5,
        windows=_layer_windows(config, layer_types),
        attn_softcap=config.attn_logit_softcapping,
        final_softcap=config.final_logit_softcapping,
        context_limit=_rope_context(config),
    )


def _gemma3(config) -> DecoderArch:
    activation = _activation(config, "hidden_activation")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise Unsupported(f"{name} is not implemented natively")
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("bidirectional attention is not a decoder")
    layer_types = tuple(config.layer_types)
    return DecoderArch(
        attn_scale=config.query_pre_attn_scalar**-0.5,
        parts=SANDWICH_PARTS,
        norm_offset=1.0,
        norm_in_float32=True,
        activation=activation,
        embed_scale=config.hidden_size**0.5,
        qk_norm="head",
        rope=layer_types,  # Gemma 3's rotary module takes the layer type
        windows=_layer_windows(config, layer_types),
        context_limit=_rope_context(config),
    )


def _sparse_layers(config) -> tuple[str, ...] | None:
    """Per layer, Qwen2/3-MoE's rule: experts unless listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step``; a gated MLP there. None: every layer has experts."""
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", 1) or 1
    kinds = tuple(
        "experts" if i not in dense and config.num_experts > 0 and (i + 1) % step == 0 else "gated"
        for i in range(config.num_hidden_layers)
    )
    return None if set(kinds) == {"experts"} else kinds


def _qwen_moe(config, shared_expert: bool, **fields) -> DecoderArch:
    experts = Experts(config.num_experts, config.num_experts_per_tok, "softmax_topk", bool(config.norm_topk_prob))
    if shared_expert:
        experts = dataclasses.replace(experts, shared_expert=True)
    return _llama(config, ffn="experts", ffn_layers=_sparse_layers(config), experts=experts, **fields)


def _qwen3_moe(config) -> DecoderArch:
    return _qwen_moe(config, False, parts=QK_NORM_PARTS, qk_norm="head")


def _qwen2_moe(config) -> DecoderArch:
    # Qwen2's attention (q, k, v biases); beside the routed experts a shared expert behind a sigmoid gate
    return _qwen_moe(config, True)


def _mixtral(config) -> DecoderArch:
    # Mistral's attention; the router's top-k logits, softmax over those (transformers: softmax, top-k, renormalized)
    experts = Experts(config.num_local_experts, config.num_experts_per_tok, "topk_softmax", True)
    return _llama(config, ffn="experts", experts=experts)


def _olmoe(config) -> DecoderArch:
    # Llama's norms; q and k normalised over the whole projection (OLMo 2's), Qwen3-MoE's router
    if getattr(config, "clip_qkv", None) is not None:
        raise Unsupported("clip_qkv (queries, keys and values clamped) is not implemented natively")
    experts = Experts(config.num_experts, config.num_experts_per_tok, "softmax_topk", bool(config.norm_topk_prob))
    return _llama(config, parts=QK_NORM_PARTS, qk_norm="proj", ffn="experts", experts=experts)


def _gpt_oss(config) -> DecoderArch:
    # q, k, v and o biases, a sink per head, alternating sliding and full layers, YaRN RoPE (the model's rotary
    # module gives its tables); a router with a bias, top-k logits then softmax over them; experts with biases
    # and a clamped SwiGLU (transformers' GptOssExperts reads no hidden_act: the clamped SwiGLU is its only one)
    layer_types = tuple(config.layer_types)
    experts = Experts(config.num_local_experts, config.num_experts_per_tok, "topk_softmax", True)
    return DecoderArch(
        attn_scale=head_dim_of(config) ** -0.5,
        parts=GPT_OSS_PARTS,
        ffn="experts",
        experts=experts,
        glu_clamp=(float(config.swiglu_alpha), float(config.swiglu_limit)),
        windows=_layer_windows(config, layer_types),
        context_limit=_rope_context(config),
    )


ARCHITECTURES: dict[str, Architecture] = {
    entry.model_type: entry
    for entry in (
        Architecture("llama", _llama, "llama", "Llama 3.x, SmolLM2"),
        Architecture("mistral", _llama, "llama", "Mistral 7B v0.3"),
        Architecture("qwen2", _llama, "qwen2", "Qwen2.5"),
        Architecture("qwen3", _qwen3, "qwen3", "Qwen3 (dense)"),
        Architecture("olmo2", _olmo2, "olmo2", "OLMo 2"),
        Architecture("olmo3", _olmo3, "olmo2", "OLMo 3"),  # llama.cpp writes it as olmo2 with a window
        Architecture("exaone4", _exaone4, "exaone4", "EXAONE 4.0"),
        Architecture("granite", _granite, "granite", "Granite 3.x"),
        Architecture("smollm3", _smollm3, "smollm3", "SmolLM3"),
        Architecture("phi3", _phi3, "phi3", "Phi-3, Phi-3.5 mini"),
        Architecture("gemma2", _gemma2, "gemma2", "Gemma 2"),
        Architecture("gemma3_text", _gemma3, "gemma3", "Gemma 3 (text)"),
        Architecture("qwen3_moe", _qwen3_moe, "qwen3moe", "Qwen3-30B-A3B (MoE)"),
        Architecture("qwen2_moe", _qwen2_moe, "qwen2moe", "Qwen1.5-MoE-A2.7B"),
        Architecture("mixtral", _mixtral, "llama", "Mixtral 8x7B"),
        Architecture("olmoe", _olmoe, "olmoe", "OLMoE-1B-7B"),
        Architecture("gpt_oss", _gpt_oss, "gpt-oss", "gpt-oss-20b, gpt-oss-120b (MoE)"),
    )
}
NATIVE_MODEL_TYPES = tuple(ARCHITECTURES)
HF_BACKEND_NOTE = "`--backend hf` loads it through transformers (`--backend auto` falls back to it)"


def decoder_arch(model) -> DecoderArch | str:
    """The layout of ``model``'s decoder, or the reason the native path cannot run it."""
    config = model.config
    entry = ARCHITECTURES.get(config.model_type)
    if entry is None:
        return f"architecture {config.model_type!r} has no native decoder (supported: {', '.join(ARCHITECTURES)})"
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "unexpected module layout"
    try:
        return entry.describe(config)
    except Unsupported as exc:
        return f"{entry.model_type}: {exc}"
    except (AttributeError, KeyError, TypeError) as exc:  # a config field the description reads is missing
        return f"{entry.model_type}: its config does not describe a native decoder ({type(exc).__name__}: {exc})"


def native_support(model) -> str | None:
    """None when the native decoder can run ``model``, else the reason it cannot."""
    arch = decoder_arch(model)
    return arch if isinstance(arch, str) else None


def layer_parts(config) -> tuple[LayerParts, float]:
    """(where a decoder layer's parts lie, the norms' weight offset) of a model of ``config``'s type:
    its entry's, or for a type without one (or a variant it refuses) the layout its family has
    (``quant/smoothing.py`` checks the modules are there)."""
    model_type = str(getattr(config, "model_type", ""))
    entry = ARCHITECTURES.get(model_type)
    if entry is not None:
        try:
            arch = entry.describe(config)
            return arch.parts, arch.norm_offset
        except (Unsupported, AttributeError, KeyError, TypeError):
            pass
    if model_type.startswith("gemma"):  # weights stored as w - 1; Gemma 1 in Llama's places, later ones sandwiched
        return (LLAMA_PARTS if model_type == "gemma" else SANDWICH_PARTS), 1.0
    return LLAMA_PARTS, 0.0
