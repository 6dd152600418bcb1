"""A transformers config from a GGUF file's metadata, without reading its tensors.

transformers rebuilds a config from GGUF metadata in ``load_gguf_checkpoint``, but only after gguf-py's
``GGUFReader`` has parsed every metadata item (~6-10 s for a 49k vocabulary, most of a first load).
This applies transformers' own tables (``GGUF_TO_TRANSFORMERS_MAPPING``, ``GGUF_CONFIG_DEFAULTS_MAPPING``)
the same way to the metadata :class:`~fastdecode.loaders.gguf_file.GGUFFile` already read, so the
result is the config transformers builds (a test compares them); what this does not cover (the
architectures transformers rebuilds with functions of their own) is refused by name.
"""

from __future__ import annotations

from fastdecode.architectures.table import GGUF_RENAMES
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
}
# Config keys the native decoder cannot run without (checked, so a file missing one is refused by name).
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def gguf_config_dict(gguf: GGUFFile) -> dict:
    """The config dict transformers' ``load_gguf_checkpoint`` builds for this file (its config part)."""
    # modeling_gguf_pytorch_utils' GGUF_TO_TRANSFORMERS_MAPPING["config"] and GGUF_SUPPORTED_ARCHITECTURES are
    # this table and its keys; importing them from there would import its tokenizer tables and, with them,
    # transformers' index of every model
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    meta = gguf.metadata
    arch = gguf.architecture
    if not arch:
        raise ModelLoadError(f"{gguf.path}: the GGUF metadata has no general.architecture")
    name = meta.get("general.name", "")
    updated = "mistral" if ("llama" in arch and "mistral" in str(name)) else GGUF_RENAMES.get(arch, arch)
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        updated = "mixtral"
    known = (*GGUF_CONFIG_MAPPING, *_MOE_KEYS)
    if arch not in known and updated not in known:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (neither fastdecode's native decoder nor "
            f"transformers' GGUF loader knows it; they know: {', '.join(sorted(known))})"
        )
    config: dict = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, {}).items():
        config.setdefault(key, value)
    renames = dict(GGUF_CONFIG_MAPPING)
    renames[updated] = {**renames.get(updated, {}), **_MOE_KEYS.get(updated, {})}
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
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ModelLoadError(f"{gguf.path}: the GGUF metadata lacks {', '.join(missing)} for architecture {arch!r}")
    return config


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
