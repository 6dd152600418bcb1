"""What a decoder architecture is, as data: :class:`DecoderArch` (norms, query and key norms,
activation and FFN kind, multipliers, each layer's RoPE and window) and :class:`LayerParts` (where
each part lies in a transformers layer). ``registry.py`` makes one from each supported config."""

from __future__ import annotations

from dataclasses import dataclass, field

NOPE = "nope"  # the RoPE key of a layer without position encoding (SmolLM3's NoPE layers)


class Unsupported(Exception):
    """A config the native decoder does not describe; its message says what."""


@dataclass(frozen=True)
class LayerParts:
    """Where each part of a decoder layer lies in a transformers ``layers[i]`` module (paths below
    it; None: the layer has no such part). ``qkv`` and ``gate_up`` list the projections whose
    outputs are fused side by side: separate q, k, v (Llama) or one fused module (Phi-3)."""

    attn_norm: str | None = "input_layernorm"
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    q_norm: str | None = None
    k_norm: str | None = None
    o: str = "self_attn.o_proj"
    post_attn_norm: str | None = None
    mlp_norm: str | None = "post_attention_layernorm"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    post_mlp_norm: str | None = None
    # an experts FFN (DecoderArch.ffn "experts"): the router's [n_experts, hidden] weight lies at router +
    # ".weight"; experts holds gate_up_proj [n_experts, 2 * inter, hidden] and down_proj [n_experts, hidden, inter]
    router: str = "mlp.gate"
    experts: str = "mlp.experts"
    shared_gate_up: tuple[str, ...] = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj")
    shared_down: str = "mlp.shared_expert.down_proj"
    shared_gate: str = "mlp.shared_expert_gate"  # [1, hidden]: sigmoid of it scales the shared expert
    # how the 3-D experts lie: "stacked" as above; "interleaved" (gpt-oss): gate_up_proj [n_experts, hidden,
    # 2 * inter], gate and up in alternate columns (gate [..., ::2], up [..., 1::2]), down_proj [n_experts,
    # inter, hidden], with biases gate_up_proj_bias [n_experts, 2 * inter] (alternating) and down_proj_bias
    experts_layout: str = "stacked"
    sinks: str | None = None  # a parameter [n_heads]: each head's attention sink (gpt-oss)

    def __post_init__(self) -> None:
        if self.experts_layout not in EXPERTS_LAYOUTS:
            raise Unsupported(f"experts layout {self.experts_layout!r} (known: {', '.join(EXPERTS_LAYOUTS)})")


EXPERTS_LAYOUTS = ("stacked", "interleaved")


LLAMA_PARTS = LayerParts()
GPT_OSS_PARTS = LayerParts(  # Llama's norms; a router with a bias, interleaved experts with biases, sinks
    mlp_norm="post_attention_layernorm",
    router="mlp.router",
    experts_layout="interleaved",
    sinks="self_attn.sinks",
)
QK_NORM_PARTS = LayerParts(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
POST_NORM_PARTS = LayerParts(  # OLMo 2: a norm after each branch only, q and k norms
    attn_norm=None,
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    post_attn_norm="post_attention_layernorm",
    mlp_norm=None,
    post_mlp_norm="post_feedforward_layernorm",
)
SANDWICH_PARTS = LayerParts(  # Gemma: a norm before and after each branch
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    post_attn_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)


GATINGS = ("softmax_topk", "topk_softmax")  # how a router's logits become the top-k experts' weights


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts FFN: each row's ``top_k`` experts by the router, their outputs weighted.

    ``gating``: ``"softmax_topk"`` - softmax over every expert's logit, the k largest probabilities kept
    (Qwen2/3-MoE, OLMoE), divided by their sum when ``renormalize`` (``norm_topk_prob``);
    ``"topk_softmax"`` - the k largest logits, softmax over those k (Mixtral: equal to softmax_topk
    renormalized, in exact arithmetic). ``shared_expert``: a gated MLP every row runs, scaled by the
    sigmoid of its own gate (Qwen2-MoE)."""

    n_experts: int
    top_k: int
    gating: str = "softmax_topk"
    renormalize: bool = False
    shared_expert: bool = False

    def __post_init__(self) -> None:
        if self.gating not in GATINGS:
            raise Unsupported(f"expert gating {self.gating!r} is not implemented natively (supported: {GATINGS})")
        if not 0 < self.top_k <= self.n_experts:
            raise Unsupported(f"top {self.top_k} of {self.n_experts} experts does not describe a router")


@dataclass(frozen=True)
class DecoderArch:
    attn_scale: float  # multiplies q . k
    parts: LayerParts = field(default=LLAMA_PARTS)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    norm_in_float32: bool = False  # the norm's weight applied before the cast back (Gemma, OLMo 2), not after
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # the gated MLP's SwiGLU clamped, (alpha, limit) (gpt-oss): gate = min(gate, limit), up = clamp(up, -limit,
    # limit), out = (up + 1) * gate * sigmoid(alpha * gate); None: plain
    glu_clamp: tuple[float, float] | None = None
    ffn: str = "gated"  # the FFN kind (backends/layer.py's FFN_KINDS): "gated" MLP or "experts"
    ffn_layers: tuple[str, ...] | None = None  # per layer: its FFN kind, where layers differ (Qwen2-MoE's dense ones)
    experts: Experts | None = None  # the experts FFN's routing, for layers of kind "experts"
    qk_norm: str | None = None  # "head": RMSNorm of each query and key head; "proj": of the whole projections
    embed_scale: float | None = None  # multiplies the embeddings: Gemma's sqrt(hidden), Granite's multiplier
    residual_scale: float = 1.0  # multiplies each branch before its residual add (Granite)
    logit_divisor: float = 1.0  # divides the logits (Granite's logits_scaling)
    attn_softcap: float | None = None  # attention scores s -> cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits likewise
    rope: tuple[str | None, ...] | None = None  # per layer: the key of its RoPE table (NOPE: none); None: one table
    windows: tuple[int | None, ...] | None = None  # per layer: sliding window in positions, None = full
    context_limit: int | None = None  # the positions its RoPE table is exact for (LongRoPE: the original length)

    def rope_key(self, layer: int) -> str | None:
        return self.rope[layer] if self.rope else None

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def ffn_kind(self, layer: int) -> str:
        return self.ffn_layers[layer] if self.ffn_layers else self.ffn


def context_length_of(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
