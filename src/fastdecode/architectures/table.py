"""What the registry supports, for the README and the loaders: the table of architectures
(native, from GGUF, with speculation) and llama.cpp's tensor names (gguf-py's ``TensorNameMap``)."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.architectures.registry import ARCHITECTURES


def gguf_tensor_name(model_type: str, module_name: str, n_layers: int) -> str | None:
    """llama.cpp's name for transformers module ``module_name`` (``model.layers.3.self_attn.q_proj``,
    ``lm_head``) of a ``model_type`` model with ``n_layers`` layers, from gguf-py's
    ``TensorNameMap`` (``blk.3.attn_q``); None where it has none or the type is not registered."""
    import gguf

    entry = ARCHITECTURES.get(model_type)
    if entry is None or entry.gguf_arch is None:
        return None
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[entry.gguf_arch]
    return gguf.get_tensor_name_map(arch, n_layers).get_name(module_name)


@dataclass(frozen=True)
class ArchitectureSupport:
    """One row of the README's table of architectures."""

    model_type: str
    example: str
    native: bool  # the native decoder runs it (batched, paged, every drafter)
    gguf: bool  # a GGUF file of it loads (its llama.cpp architecture is one the loader reads)
    speculation: bool  # speculative decoding, lossless, at any weight format


# llama.cpp's architecture names that transformers spells differently (``load_gguf_checkpoint``'s renames)
GGUF_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# GGUF architectures whose config loaders/gguf_config.py maps itself (transformers' GGUF tables lack them)
GGUF_OWN_CONFIGS = ("olmoe", "olmo2", "exaone4", "granite", "smollm3")
# GGUF architectures whose q and k rows llama.cpp's converter permutes for ggml's RoPE (LlamaModel.permute:
# LlamaModel and its subclasses with undo_permute, GraniteModel and SmolLM3Model; Mixtral is a "llama")
GGUF_PERMUTED = ("llama", "granite", "smollm3")
# What llama.cpp's graph fixes where a GGUF has no key (a model that differs cannot be written, and a file
# reads back as this): SmolLM3's NoPE layers, every fourth (n_no_rope_layer_step)
LLAMA_CPP_NOPE_STEP = 4
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}  # llama.cpp's Gemma 27B models, by layer count


def gemma_query_scalar(model_type: str, n_layers: int, head_dim: int, hidden: int, n_heads: int) -> int:
    """The query_pre_attn_scalar of llama.cpp's Gemma 2 and 3 graphs (``f_attention_scale``; a GGUF keeps no
    key for it): head_dim, the 27B's hidden / heads."""
    return hidden // n_heads if _GEMMA_27B_LAYERS.get(model_type) == n_layers else head_dim


def _gguf_loadable(gguf_arch: str | None) -> bool:
    """Whether ``loading.py`` reads a GGUF file of ``gguf_arch`` (transformers' GGUF config tables, or ours)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if gguf_arch is None:
        return False
    return GGUF_RENAMES.get(gguf_arch, gguf_arch) in GGUF_CONFIG_MAPPING or gguf_arch in GGUF_OWN_CONFIGS


def supported_architectures() -> list[ArchitectureSupport]:
    """Every registered architecture, in registry order."""
    return [
        ArchitectureSupport(e.model_type, e.example, True, _gguf_loadable(e.gguf_arch), True)
        for e in ARCHITECTURES.values()
    ]


def architectures_markdown() -> str:
    """:func:`supported_architectures` as the README's Markdown table."""
    mark = {True: "yes", False: "no"}
    lines = ["| model_type | e.g. | native | from GGUF | speculation |", "|---|---|---|---|---|"]
    lines += [
        f"| `{r.model_type}` | {r.example} | {mark[r.native]} | {mark[r.gguf]} | {mark[r.speculation]} |"
        for r in supported_architectures()
    ]
    return "\n".join(lines)
