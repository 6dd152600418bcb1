"""A model's config without transformers' config classes: :class:`ConfigView`, built from a flat dict
(a GGUF file's metadata as ``loaders/gguf_config.py`` maps it) with the defaults and the derived fields
(``layer_types``, ``sliding_window``, ``rope_parameters`` ...) transformers' ``configuration_<type>.py``
gives, for the fields the native decoder, its skeleton and the engine read.

Importing a transformers config class imports much of transformers' modeling machinery; a GGUF file the
native decoder runs needs none of it. ``tests/architectures/test_config_view.py`` builds each type both
ways and compares every field listed in :data:`DECODER_FIELDS`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

# The fields compared against transformers' config (the test): what registry.py's descriptions,
# backends/native.py, the GGUF skeleton, the block formats and the engine (eos) read.
DECODER_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "hidden_activation",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "partial_rotary_factor",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "no_rope_layers",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "attention_bias",
    "mlp_bias",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "attention_multiplier",
    "embedding_multiplier",
    "residual_multiplier",
    "logits_scaling",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "clip_qkv",
    "original_max_position_embeddings",
    "swiglu_alpha",
    "swiglu_limit",
)

_LLAMA_IDS = dict(eos_token_id=2, bos_token_id=1, pad_token_id=None)
_QWEN_IDS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
_GEMMA_IDS = dict(eos_token_id=1, bos_token_id=2, pad_token_id=0)
_OLMO_IDS = dict(eos_token_id=50279, bos_token_id=None, pad_token_id=1)
_QWEN_WINDOW = dict(sliding_window=4096, use_sliding_window=False)
_GEMMA = dict(
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    num_key_value_heads=4,
    head_dim=256,
    sliding_window=4096,
    attention_bias=False,
    query_pre_attn_scalar=256,
    layer_types=None,
    **_GEMMA_IDS,
)

# Per model_type: the dataclass defaults of transformers' config class (5.x) for the fields above, and
# its default RoPE base ("rope_theta"); a field it does not have is absent here too.
DEFAULTS: dict[str, dict] = {
    "llama": dict(
        vocab_size=32000, num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **_LLAMA_IDS,
    ),
    "mistral": dict(
        vocab_size=32000, num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=4096, **_LLAMA_IDS,
    ),
    "qwen2": dict(
        vocab_size=151936, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_window_layers=28, layer_types=None, **_QWEN_WINDOW, **_QWEN_IDS,
    ),
    "qwen3": dict(
        vocab_size=151936, num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_window_layers=28, attention_bias=False, layer_types=None,
        **_QWEN_WINDOW, **_QWEN_IDS,
    ),
    "olmo2": dict(
        vocab_size=50304, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, **_OLMO_IDS,
    ),
    "olmo3": dict(
        vocab_size=50304, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=4096, attention_bias=False, layer_types=None, **_OLMO_IDS,
    ),
    "exaone4": dict(
        vocab_size=102400, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=4096, sliding_window_pattern=4, layer_types=None,
        eos_token_id=2, bos_token_id=0, pad_token_id=None,
    ),
    "granite": dict(
        vocab_size=32000, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_multiplier=1.0,
        embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0, **_LLAMA_IDS,
    ),
    "smollm3": dict(
        vocab_size=128256, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, sliding_window=None, use_sliding_window=False, no_rope_layer_interval=4,
        attention_bias=False, mlp_bias=False, layer_types=None, no_rope_layers=None, rope_theta=2_000_000.0,
        eos_token_id=128001, bos_token_id=128000, pad_token_id=128004,
    ),
    "phi3": dict(
        vocab_size=32064, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=None, original_max_position_embeddings=4096,
        eos_token_id=32000, bos_token_id=1, pad_token_id=32000,
    ),
    "gemma2": dict(
        _GEMMA, vocab_size=256000, max_position_embeddings=8192, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, use_bidirectional_attention=None,
    ),
    "gemma3_text": dict(
        _GEMMA, vocab_size=262208, max_position_embeddings=131072, attn_logit_softcapping=None,
        final_logit_softcapping=None, use_bidirectional_attention=False,
    ),
    "qwen3_moe": dict(
        vocab_size=151936, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, num_experts=128, num_experts_per_tok=8, norm_topk_prob=False,
        mlp_only_layers=None, decoder_sparse_step=1, moe_intermediate_size=768, **_QWEN_WINDOW, **_QWEN_IDS,
    ),
    "qwen2_moe": dict(
        vocab_size=151936, num_key_value_heads=16, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_window_layers=28, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
        mlp_only_layers=None, decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        layer_types=None, **_QWEN_WINDOW, **_QWEN_IDS,
    ),
    "mixtral": dict(
        vocab_size=32000, num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        rope_theta=1_000_000.0, **_LLAMA_IDS,
    ),
    "olmoe": dict(
        vocab_size=50304, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        clip_qkv=None, **_OLMO_IDS,
    ),
    "gpt_oss": dict(
        vocab_size=201088, num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=128, layer_types=None, attention_bias=True,
        num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, rope_theta=150_000.0,
        rope_parameters=None, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    ),
}  # fmt: skip
# transformers' attribute_map: the second name reads the first (Mixtral's num_experts is num_local_experts)
ALIASES = {
    "mixtral": ("num_local_experts", "num_experts"),
    "qwen3_moe": ("num_local_experts", "num_experts"),
    "olmoe": ("num_experts", "num_local_experts"),
    "gpt_oss": ("num_local_experts", "num_experts"),
}
_THETA = 10_000.0  # RotaryEmbeddingConfigMixin.default_theta
_SCALED_ROPES = ("llama3", "yarn", "longrope")  # those that carry original_max_position_embeddings


class ConfigView:
    """A config's fields as attributes (``config.hidden_size``), as transformers' config of its
    ``model_type`` has them. Not a transformers class: ``describe`` functions, the native decoder and
    transformers' RoPE functions (``modeling_rope_utils``) read it like one."""

    def __init__(self, fields: dict) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return copy.deepcopy(vars(self))

    def standardize_rope_params(self) -> None:
        """transformers' RoPE functions call this; :func:`config_view` standardized them already."""

    @property
    def per_layer_config(self):
        """transformers' RoPE functions look a layer type up here first (Gemma 4's per-layer configs) and
        take a ValueError as "none": the types viewed here keep one config for every layer."""
        raise ValueError("no per-layer config")

    def __repr__(self) -> str:
        return f"ConfigView({self.model_type!r}, {len(vars(self))} fields)"


def every_nth_full(n_layers: int, step: int) -> list[str]:
    """layer_types with every ``step``-th layer full attention, the others sliding (transformers' config
    classes' defaults: Gemma 2 every 2nd, Gemma 3 every 6th, OLMo 3 and EXAONE 4 every 4th)."""
    return ["sliding_attention" if (i + 1) % step else "full_attention" for i in range(n_layers)]


def _kv_heads(c: dict) -> None:
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]


def _head_dim(c: dict) -> None:
    if c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]


def _divisible(c: dict) -> None:
    if c["hidden_size"] % c["num_attention_heads"]:
        raise ValueError(
            f"The hidden size ({c['hidden_size']}) is not a multiple of the number of attention heads "
            f"({c['num_attention_heads']})."
        )


def _qwen_layers(c: dict) -> None:
    c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else None
    _kv_heads(c)
    if c["layer_types"] is None:
        window = c["sliding_window"] is not None
        c["layer_types"] = [
            "sliding_attention" if window and i >= c["max_window_layers"] else "full_attention"
            for i in range(c["num_hidden_layers"])
        ]


def _qwen3_moe(c: dict) -> None:
    c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else None
    c["mlp_only_layers"] = c["mlp_only_layers"] or []


def _qwen2_moe(c: dict) -> None:
    c["mlp_only_layers"] = c["mlp_only_layers"] or []
    c["sliding_window"] = c["sliding_window"] if c["use_sliding_window"] else 0
    if c["layer_types"] is None:
        c["layer_types"] = [
            "sliding_attention"
            if (i + 1) % 2 and i < c["max_window_layers"] and c["use_sliding_window"]
            else "full_attention"
            for i in range(c["num_hidden_layers"])
        ]


def _exaone4(c: dict) -> None:
    if c["sliding_window"] is None:
        c["sliding_window_pattern"] = 0
    if c["layer_types"] is None:
        pattern = c["sliding_window_pattern"]
        if not isinstance(pattern, int) or pattern <= 0:
            raise ValueError(f"sliding_window_pattern {pattern!r} does not give each layer's attention")
        c["layer_types"] = every_nth_full(c["num_hidden_layers"], pattern)


def _every_other(c: dict) -> None:  # Gemma 2
    _divisible(c)
    if c["layer_types"] is None:
        c["layer_types"] = every_nth_full(c["num_hidden_layers"], 2)


def _gemma3(c: dict) -> None:
    _divisible(c)
    if c["use_bidirectional_attention"]:
        c["sliding_window"] = c["sliding_window"] // 2 + 1
    pattern = c.pop("sliding_window_pattern", 6)
    if c["layer_types"] is None:
        c["layer_types"] = every_nth_full(c["num_hidden_layers"], pattern)


def _olmo3(c: dict) -> None:
    _kv_heads(c)
    if c["layer_types"] is None:
        c["layer_types"] = every_nth_full(c["num_hidden_layers"], 4)


def _smollm3(c: dict) -> None:
    _kv_heads(c)
    if c["no_rope_layers"] is None:
        interval = c["no_rope_layer_interval"]
        c["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(c["num_hidden_layers"])]
    if c["layer_types"] is None:
        window = c["use_sliding_window"] and c["sliding_window"] is not None
        c["layer_types"] = [
            "sliding_attention" if window and not has_rope else "full_attention" for has_rope in c["no_rope_layers"]
        ]


def _llama(c: dict) -> None:
    _kv_heads(c)
    _head_dim(c)
    _divisible(c)


def _mistral(c: dict) -> None:
    _head_dim(c)
    _kv_heads(c)


def _gpt_oss(c: dict) -> None:
    _kv_heads(c)
    _head_dim(c)
    if c["layer_types"] is None:
        c["layer_types"] = every_nth_full(c["num_hidden_layers"], 2)
    if c["rope_parameters"] is None and not c.get("rope_scaling"):  # its default: YaRN, 32 x 4096 positions
        c["rope_parameters"] = dict(
            rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=4096,
        )  # fmt: skip


# Per model_type: transformers' __post_init__ (the fields it derives from the others)
_DERIVE: dict[str, Callable[[dict], None]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen_layers,
    "qwen3": _qwen_layers,
    "olmo2": _kv_heads,
    "olmo3": _olmo3,
    "exaone4": _exaone4,
    "granite": _kv_heads,
    "smollm3": _smollm3,
    "phi3": _kv_heads,
    "gemma2": _every_other,
    "gemma3_text": _gemma3,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _kv_heads,
    "olmoe": _kv_heads,
    "gpt_oss": _gpt_oss,
}


def _standard_rope(c: dict, theta: float) -> None:
    """transformers' ``convert_rope_params_to_dict`` and ``standardize_rope_params`` for one flat table."""
    rope = dict(c.pop("rope_scaling", None) or c.get("rope_parameters") or {})
    rope.setdefault("rope_theta", c.pop("rope_theta", theta))
    partial = c.pop("partial_rotary_factor", None)
    if c["model_type"] == "phi3":
        rope.setdefault("partial_rotary_factor", 1.0 if partial is None else partial)
    elif partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in _SCALED_ROPES:
        if "original_max_position_embeddings" in c:  # Phi-3 keeps it beside the table: that one wins
            rope["original_max_position_embeddings"] = c["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    if c["model_type"] == "phi3" and rope["rope_type"] in ("su", "yarn"):
        rope["rope_type"] = "longrope"
    c["rope_parameters"] = rope


# model_type -> (the full-attention table's default base, the key of the sliding one's base, its default):
# the types whose config class keeps a RoPE table per layer type (Gemma 3: a local base; OLMo 3: its
# class pops rope_theta for the full table, so the sliding one keeps the default)
_PER_TYPE_ROPE = {
    "gemma3_text": (1_000_000.0, "rope_local_base_freq", _THETA),
    "olmo3": (500_000.0, "rope_theta", 500_000.0),
}


def _per_type_rope(c: dict) -> None:
    """A RoPE table per layer type, as Gemma 3's and OLMo 3's ``convert_rope_params_to_dict`` make them."""
    full_theta, local_key, local_theta = _PER_TYPE_ROPE[c["model_type"]]
    rope = copy.deepcopy(c.get("rope_parameters") or {})
    full = rope.get("full_attention") or {"rope_type": "default"}
    full.update(c.pop("rope_scaling", None) or {})
    full.setdefault("rope_theta", c.pop("rope_theta", full_theta))
    local = rope.get("sliding_attention") or {"rope_type": "default"}
    local.setdefault("rope_theta", c.pop(local_key, local_theta))
    for table in (full, local):
        table.setdefault("rope_type", table.get("type", "default"))
        if table["rope_type"] in _SCALED_ROPES:
            table.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    rope.update(sliding_attention=local, full_attention=full)
    c["rope_parameters"] = rope


_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The types transformers' strict config classes hold these fields to (an int where a float is declared
# is refused, as is a bool where an int is); None passes where the default is None.
_KINDS = {
    **dict.fromkeys(
        (*_INTS, "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "max_window_layers")
        + ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_local_experts")
        + ("num_experts_per_tok", "decoder_sparse_step", "query_pre_attn_scalar", "original_max_position_embeddings"),
        int,
    ),
    **dict.fromkeys(
        ("rms_norm_eps", "attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")
        + ("attn_logit_softcapping", "final_logit_softcapping", "swiglu_alpha", "swiglu_limit"),
        float,
    ),
    **dict.fromkeys(
        ("tie_word_embeddings", "use_sliding_window", "norm_topk_prob", "attention_bias", "mlp_bias")
        + ("use_bidirectional_attention",),
        bool,
    ),
}


def _check_kinds(model_type: str, fields: dict) -> None:
    declared = {*DEFAULTS[model_type], *_INTS, "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"}
    for key, value in fields.items():
        kind = _KINDS.get(key)
        if kind is None or key not in declared or (value is None and DEFAULTS[model_type].get(key, 0) is None):
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{key} must be of type {kind.__name__}, got {value!r}")
        if key in _INTS and value <= 0:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def config_view(fields: dict) -> ConfigView | None:
    """The :class:`ConfigView` of ``fields`` (a flat config dict naming its ``model_type``), or None for a
    type this module has no defaults for (then transformers' config class is the one to build). Raises
    ValueError where transformers' config class would refuse the values (a size not a positive int, a
    float where an int is declared ...): the loader then builds transformers' config, which says why."""
    model_type = fields.get("model_type")
    if model_type not in DEFAULTS:
        return None
    _check_kinds(model_type, fields)
    c = {**copy.deepcopy(DEFAULTS[model_type]), **copy.deepcopy(fields)}
    try:
        _DERIVE[model_type](c)
    except KeyError as exc:
        raise ValueError(f"{model_type}: the config lacks {exc}") from None
    if model_type in _PER_TYPE_ROPE:
        _per_type_rope(c)
    else:
        _standard_rope(c, _THETA)
    alias = ALIASES.get(model_type, ())
    if alias:  # one value under both names: the one ``fields`` gives, else the default
        c[alias[0]] = c[alias[1]] = next((fields[k] for k in alias if k in fields), c.get(alias[0], c.get(alias[1])))
    return ConfigView(c)
