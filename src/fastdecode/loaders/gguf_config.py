"""A transformers config from a GGUF file's metadata, without reading its tensors.

transformers rebuilds a config from GGUF metadata in ``load_gguf_checkpoint``, but only after gguf-py's
``GGUFReader`` has parsed every metadata item (~6-10 s for a 49k vocabulary, most of a first load).
This applies transformers' own tables (``GGUF_TO_TRANSFORMERS_MAPPING``, ``GGUF_CONFIG_DEFAULTS_MAPPING``)
the same way to the metadata :class:`~fastdecode.loaders.gguf_file.GGUFFile` already read, so where those
tables cover a file the result is the config transformers builds (a test compares them). Where they stop
short, ours (``_MOE_KEYS``, ``_DENSE_KEYS``) map the keys llama.cpp's converter writes, ``_DERIVED`` gives
what llama.cpp's graph fixes where the file has no key, and a Llama 3 RoPE is read back from the
rope_freqs tensor (transformers reads the default RoPE). An architecture none of them knows is refused by
name, as is a file missing a required key.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from fastdecode.architectures.config_view import every_nth_full
from fastdecode.architectures.table import GGUF_RENAMES, LLAMA_CPP_NOPE_STEP, gemma_query_scalar
from fastdecode.errors import ModelLoadError
from fastdecode.loaders.gguf_file import GGUFFile

# The mixtures of experts' keys transformers' GGUF tables (GGUF_TO_TRANSFORMERS_MAPPING, 5.x) leave out,
# by transformers' model_type: the experts' FFN sizes (else Qwen2/3-MoE's configs take their defaults,
# 1408 and 768, whatever the file holds); Mixtral, a GGUF "llama" with experts (llama.cpp writes it so;
# transformers would read a dense Llama); OLMoE, which transformers' tables do not have at all.
_BASE_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_MOE_KEYS = {
    "qwen2_moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "mixtral": {**_BASE_KEYS, "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "olmoe": {**_BASE_KEYS, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"},
    # gpt-oss: transformers' table (5.24) leaves out the head size (its config's default, 64, would stand
    # whatever the file holds), the experts' width, and reads the window from a key llama.cpp does not write
    # ("sliding_window", not "attention.sliding_window"); its YaRN RoPE is _yarn_rope's
    "gpt_oss": {
        "attention.key_length": "head_dim",
        "attention.sliding_window": "sliding_window",
        "expert_feed_forward_length": "intermediate_size",
    },
}
# YaRN RoPE from {arch}.rope.scaling.* (transformers' tables leave it out: the config's default would stand,
# whatever the file says), by model_type, with what the file cannot say: gpt-oss's YaRN is untruncated
_YARN = {"gpt_oss": {"truncate": False}}
# The dense architectures' keys transformers' tables (5.x) leave out, by transformers' model_type, as
# llama.cpp's converter writes them: OLMo 2 and 3 (one GGUF "olmo2"; OLMo 3 with its window), EXAONE 4, Granite
# (its multipliers under llama.cpp's *_scale names) and SmolLM3, which those tables do not have at all; and
# the keys they drop of those they have: attention.key_length (a Qwen3 whose head_dim is not hidden / heads
# would read as 128, the config's default), Phi-3's window and original context, Gemma's soft caps (else
# transformers' defaults, 50 and 30, whatever the file holds).
_KEY_LENGTH = {"attention.key_length": "head_dim"}
_DENSE_KEYS = {
    "olmo2": {**_BASE_KEYS, **_KEY_LENGTH},
    "olmo3": {**_BASE_KEYS, **_KEY_LENGTH, "attention.sliding_window": "sliding_window"},
    "exaone4": {**_BASE_KEYS, **_KEY_LENGTH, "attention.sliding_window": "sliding_window"},
    "granite": {
        **_BASE_KEYS,
        "attention.scale": "attention_multiplier",
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
    "smollm3": {**_BASE_KEYS, **_KEY_LENGTH},
    "qwen2": _KEY_LENGTH,
    "qwen3": _KEY_LENGTH,
    "phi3": {
        "attention.sliding_window": "sliding_window",
        "rope.scaling.original_context_length": "original_max_position_embeddings",
    },
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "gemma3": {"final_logit_softcapping": "final_logit_softcapping"},
}
_OWN_KEYS = {**_MOE_KEYS, **_DENSE_KEYS}
# Config keys the native decoder cannot run without (checked, so a file missing one is refused by name).
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


_TABLES = ("GGUF_CONFIG_MAPPING", "GGUF_CONFIG_DEFAULTS_MAPPING")


@functools.lru_cache(maxsize=1)
def transformers_tables() -> tuple[dict, dict]:
    """transformers' ``GGUF_CONFIG_MAPPING`` and ``GGUF_CONFIG_DEFAULTS_MAPPING`` (``integrations/ggml.py``).

    modeling_gguf_pytorch_utils' GGUF_TO_TRANSFORMERS_MAPPING["config"] and GGUF_SUPPORTED_ARCHITECTURES are
    the first and its keys. Both are dict literals: they are read from the module's source, found without
    executing transformers' package, whose import (its ``__init__`` and dependency checks) would cost a load
    over a second; where the source is not two literals any more, they are imported."""
    try:
        spec = importlib.util.find_spec("transformers")  # a top-level package: found, not run
        source = Path(spec.origin).parent / "integrations" / "ggml.py"
        found = {
            node.targets[0].id: ast.literal_eval(node.value)
            for node in ast.parse(source.read_text(encoding="utf-8")).body
            if isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in _TABLES
        }
        return found[_TABLES[0]], found[_TABLES[1]]
    except (AttributeError, TypeError, OSError, SyntaxError, ValueError, KeyError):
        from transformers.integrations import ggml

        return ggml.GGUF_CONFIG_MAPPING, ggml.GGUF_CONFIG_DEFAULTS_MAPPING


def _model_type(gguf: GGUFFile) -> str:
    """transformers' name for the file's architecture (``load_gguf_checkpoint``'s renames, and ours)."""
    meta, arch = gguf.metadata, gguf.architecture
    if "llama" in arch and "mistral" in str(meta.get("general.name", "")):
        return "mistral"
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    if arch == "olmo2" and "olmo2.attention.sliding_window" in meta:  # Olmo2Model writes OLMo 3 so
        return "olmo3"
    return GGUF_RENAMES.get(arch, arch)


def gguf_config_dict(gguf: GGUFFile) -> dict:
    """The config dict transformers' ``load_gguf_checkpoint`` builds for this file (its config part)."""
    mapping, defaults = transformers_tables()
    meta = gguf.metadata
    arch = gguf.architecture
    if not arch:
        raise ModelLoadError(f"{gguf.path}: the GGUF metadata has no general.architecture")
    updated = _model_type(gguf)
    known = (*mapping, *_OWN_KEYS)
    if arch not in known and updated not in known:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (neither fastdecode's native decoder nor "
            f"transformers' GGUF loader knows it; they know: {', '.join(sorted(set(known)))})"
        )
    config: dict = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for key, value in defaults.get(updated, {}).items():
        config.setdefault(key, value)
    renames = dict(mapping)
    renames[updated] = {**renames.get(updated, {}), **_OWN_KEYS.get(updated, {})}
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        prefix = updated if prefix == arch else prefix
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        target = renames.get(prefix, {}).get(rest)
        if target is not None and target != -1:
            config[target] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config:
        tokens = meta.get("tokenizer.ggml.tokens")
        if isinstance(tokens, int):
            config["vocab_size"] = tokens
        elif isinstance(tokens, list):
            config["vocab_size"] = len(tokens)
    _check_required(gguf, config, renames[updated])
    _DERIVED.get(config["model_type"], _nothing)(gguf, config)
    _rope_scaling(gguf, config)
    if "rope_freqs.weight" in gguf.tensors and "rope_parameters" not in config:
        _llama3_rope(gguf, config)
    return config


def _yarn_rope(meta: dict, arch: str, config: dict, fixed: dict) -> None:
    """config["rope_parameters"] from the file's YaRN keys (as llama.cpp's converter writes them)."""
    key = f"{arch}.rope.scaling."
    rope = {"rope_type": "yarn", "rope_theta": config.get("rope_theta", 10000.0), **fixed}
    for name, field in (
        ("factor", "factor"),
        ("original_context_length", "original_max_position_embeddings"),
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        if key + name in meta:
            rope[field] = meta[key + name]
    config["rope_parameters"] = rope


def _rope_scaling(gguf: GGUFFile, config: dict) -> None:
    """``rope.scaling.type`` "linear" (``rope.scaling.factor``), which transformers' tables do not read: on
    every layer, Gemma 3's global ones only (llama.cpp scales its local ones by 1); "yarn" for the types
    :data:`_YARN` knows (gpt-oss); another type is refused rather than read as the default RoPE."""
    kind = gguf.metadata.get(f"{gguf.architecture}.rope.scaling.type")
    if kind in (None, "none"):
        return
    if kind == "yarn" and config["model_type"] in _YARN:
        _yarn_rope(gguf.metadata, gguf.architecture, config, _YARN[config["model_type"]])
        return
    factor = gguf.metadata.get(f"{gguf.architecture}.rope.scaling.factor")
    if kind != "linear" or factor is None:
        raise ModelLoadError(
            f"{gguf.path}: {gguf.architecture}.rope.scaling.type {kind!r} (factor {factor}) is not read here "
            "(linear with a factor is)"
        )
    linear = {"rope_type": "linear", "factor": float(factor), "rope_theta": float(config.pop("rope_theta", 10000.0))}
    if config["model_type"] == "gemma3_text":
        local_theta = float(gguf.metadata.get("gemma3.rope.freq_base_swa", 10000.0))  # llama.cpp's default
        local = {"rope_type": "default", "rope_theta": local_theta}
        config["rope_parameters"] = {"full_attention": linear, "sliding_attention": local}
    else:
        config["rope_parameters"] = linear


def _check_required(gguf: GGUFFile, config: dict, renames: dict) -> None:
    """One error naming the GGUF key (``olmo2.embedding_length``) of each required value the file lacks."""
    required = [*REQUIRED, "rms_norm_eps"] if "attention.layer_norm_rms_epsilon" in renames else REQUIRED
    missing = [k for k in required if k not in config]
    if missing:
        by_target = {target: key for key, target in renames.items()}
        keys = [f"{gguf.architecture}.{by_target[k]}" if k in by_target else k for k in missing]
        raise ModelLoadError(
            f"{gguf.path}: the GGUF metadata lacks {', '.join(keys)}, which architecture {gguf.architecture!r} needs"
        )


def _nothing(gguf: GGUFFile, config: dict) -> None:
    return None


def _window_pattern(gguf: GGUFFile, config: dict, default_step: int) -> None:
    """layer_types from ``attention.sliding_window_pattern`` (per layer, True: sliding), else llama.cpp's
    default for the architecture (every ``default_step``-th layer full); none without a window."""
    pattern = gguf.metadata.get(f"{gguf.architecture}.attention.sliding_window_pattern")
    n_layers = int(config["num_hidden_layers"])
    if config.get("sliding_window") is None:
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * n_layers
        return
    if pattern is None:
        config["layer_types"] = every_nth_full(n_layers, default_step)
        return
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise ModelLoadError(
            f"{gguf.path}: {gguf.architecture}.attention.sliding_window_pattern must hold one flag per layer "
            f"({n_layers}), not {pattern!r}"
        )
    config["layer_types"] = ["sliding_attention" if bool(p) else "full_attention" for p in pattern]


def _granite(gguf: GGUFFile, config: dict) -> None:
    # without attention.scale llama.cpp scales q . k by 1/sqrt(head_dim) (transformers' default is 1.0)
    head_dim = int(config["hidden_size"]) // int(config["num_attention_heads"])
    config.setdefault("attention_multiplier", head_dim**-0.5)


def _smollm3(gguf: GGUFFile, config: dict) -> None:
    config["no_rope_layer_interval"] = LLAMA_CPP_NOPE_STEP  # llama.cpp's fixed step: no key says it
    config["use_sliding_window"] = False


def _phi3(gguf: GGUFFile, config: dict) -> None:
    """Phi-3: window 0 is none; LongRoPE from its rope_factors_long / rope_factors_short tensors."""
    config["sliding_window"] = config.get("sliding_window") or None
    names = ("rope_factors_long.weight", "rope_factors_short.weight")
    found = [n in gguf.tensors for n in names]
    if not any(found):
        return
    if not all(found) or "original_max_position_embeddings" not in config:
        raise ModelLoadError(
            f"{gguf.path}: LongRoPE needs rope_factors_long, rope_factors_short and "
            "phi3.rope.scaling.original_context_length; the file has only some of them"
        )
    long, short = (gguf.values(n).astype(float).reshape(-1).tolist() for n in names)
    rope = {
        "rope_type": "longrope",
        "rope_theta": float(config.pop("rope_theta", 10000.0)),
        "long_factor": long,
        "short_factor": short,
        "original_max_position_embeddings": int(config["original_max_position_embeddings"]),
    }
    factor = gguf.metadata.get("phi3.rope.scaling.attn_factor")
    if factor is not None:
        rope["attention_factor"] = float(factor)
    config["rope_parameters"] = rope


def _gemma(gguf: GGUFFile, config: dict) -> None:
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    config["query_pre_attn_scalar"] = gemma_query_scalar(
        config["model_type"],
        int(config["num_hidden_layers"]),
        head_dim,
        int(config["hidden_size"]),
        int(config["num_attention_heads"]),
    )


def _llama3_rope(gguf: GGUFFile, config: dict) -> None:
    """Llama 3's RoPE from the rope_freqs tensor, its only trace in a GGUF (``LlamaModel.generate_extra_tensors``;
    transformers' loader ignores it and reads the default RoPE).

    Per frequency i the converter stores f_i = 1 where the wavelength is short, ``factor`` where it is long,
    and between 1 / ((1 - s_i) / factor + s_i) with s_i = A / wavelen_i + B, A = original / (high - low),
    B = -low / (high - low): those factors fix ``factor`` (their largest), A and B (a line through the
    middle ones), and with low_freq_factor = 1 the rest: high = 1 - 1 / B, original = -A / B; the factors
    the recovered parameters give are checked against the file's."""
    import numpy as np

    factors = gguf.values("rope_freqs.weight").astype(np.float64).reshape(-1)
    if np.all(factors == 1.0):
        return
    theta = float(config.get("rope_theta", 10000.0))
    dim = 2 * factors.size
    inv_wavelen = 1.0 / (2 * np.pi * theta ** (np.arange(0, dim, 2) / dim))
    factor = float(factors.max())
    middle = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    fitted = None
    if middle.sum() >= 2 and factor > 1.0:
        smooth = (1.0 / factors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(inv_wavelen[middle], smooth, 1)
        if b < 0 and a > 0:
            fitted = dict(factor=factor, low_freq_factor=1.0, high_freq_factor=round(float(1 - 1 / b), 4))
            fitted["original_max_position_embeddings"] = int(round(-a / b))
    if fitted is None or not np.allclose(_llama3_factors(inv_wavelen, **fitted), factors, rtol=1e-4):
        raise ModelLoadError(f"{gguf.path}: rope_freqs.weight holds factors that are not Llama 3's RoPE scaling")
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": theta, **fitted}


def _llama3_factors(inv_wavelen, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """The rope_freqs a Llama 3 RoPE of these parameters gives (the converter's formula)."""
    import numpy as np

    smooth = (original_max_position_embeddings * inv_wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    middle = 1.0 / ((1 - smooth) / factor + smooth)
    long_wave = inv_wavelen < low_freq_factor / original_max_position_embeddings
    short_wave = inv_wavelen > high_freq_factor / original_max_position_embeddings
    return np.where(short_wave, 1.0, np.where(long_wave, factor, middle))


# transformers' model_type -> what it reads of the file beyond renamed keys (llama.cpp's rules where the
# file has no key: see each function)
_DERIVED = {
    "olmo3": lambda gguf, config: _window_pattern(gguf, config, 4),  # Olmo2Model's default: every 4th full
    "exaone4": lambda gguf, config: _window_pattern(gguf, config, 4),
    "granite": _granite,
    "smollm3": _smollm3,
    "phi3": _phi3,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
}


def gguf_config(gguf: GGUFFile):
    """The transformers ``PretrainedConfig`` for this file (``AutoConfig.for_model``, as transformers does)."""
    return config_from_dict(gguf, gguf_config_dict(gguf))


def config_from_dict(gguf: GGUFFile, config: dict):
    """``AutoConfig.for_model`` of a dict :func:`gguf_config_dict` built (one clear error if it cannot)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{gguf.path}: cannot build a config from its metadata ({exc})") from None
