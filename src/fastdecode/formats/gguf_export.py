"""Writing GGUF files as llama.cpp's ``convert_hf_to_gguf.py`` writes them, with gguf-py's writer.

Two callers share this: :func:`export_gguf` turns a (small, float) transformers model into
the file llama.cpp's converter would write, its tensors quantized by gguf-py
(``gguf.quants.quantize``), so a test can compare a GGUF-loaded model against
transformers; ``fastdecode.bench.synthetic_gguf`` writes random-weight files at the shapes
of real models for benchmarks and memory tests.

Terms: a :class:`DecoderShape` is a dense decoder's hyperparameters, written as the
``{arch}.*`` metadata keys; a :class:`TensorPlan` is one tensor's name, shape (numpy
order: ``[rows, cols]``, the reverse of GGUF's) and GGML type, with a callable that makes
its bytes. :func:`write_gguf` writes every tensor's info first and then the data tensor
by tensor, so no more than one tensor is in memory at a time (an 8B file never is).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastdecode.architectures import layer_parts
from fastdecode.architectures.config_view import every_nth_full
from fastdecode.errors import ConfigError
from fastdecode.formats.gguf_arch_fields import arch_fields


@dataclass(frozen=True)
class DecoderShape:
    """A dense decoder's hyperparameters, under the names llama.cpp's metadata gives them."""

    arch: str  # gguf's general.architecture: "llama", "qwen2", "qwen3", "gemma3", "olmo2", "phi3" ...
    hidden_size: int  # {arch}.embedding_length
    num_layers: int  # {arch}.block_count
    num_heads: int
    num_kv_heads: int
    head_dim: int  # {arch}.attention.key_length and value_length
    intermediate_size: int  # {arch}.feed_forward_length
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float = 1e-5
    tied_embeddings: bool = True  # no output.weight: the logits reuse token_embd
    qk_norm: bool = False  # qwen3, gemma3: attn_q_norm / attn_k_norm per head
    attn_bias: bool = False  # qwen2: q, k and v have biases
    # Llama 3's RoPE scaling (rope_type "llama3"): factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings; written as the rope_freqs tensor, as the converter does.
    llama3_rope: dict | None = None
    rope_linear_factor: float | None = (
        None  # rope.scaling.type "linear" and rope.scaling.factor (Gemma 3: global layers)
    )
    sliding_window: int | None = None  # gemma2/3, olmo2 (OLMo 3), exaone4, phi3 (0: none)
    # per layer, True where it is a sliding-window layer (OLMo 3, EXAONE 4): attention.sliding_window_pattern
    sliding_window_pattern: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None  # gemma3's sliding layers
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # gemma2
    # Granite's multipliers (GraniteModel.set_gguf_parameters): attention.scale, embedding_scale,
    # residual_scale, logit_scale (the logits are divided by it)
    attention_scale: float | None = None
    embedding_scale: float | None = None
    residual_scale: float | None = None
    logit_scale: float | None = None
    # Phi-3's LongRoPE: rope.scaling.original_context_length, rope.scaling.attn_factor and the
    # rope_factors_long / rope_factors_short tensors (Phi3MiniModel.generate_extra_tensors)
    rope_original_context: int | None = None
    rope_attn_factor: float | None = None
    longrope_factors: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # (long, short), [head_dim // 2] each
    head_dim_keys: bool = True  # attention.key_length / value_length (Granite's and Phi-3's converters write none)
    # a mixture of experts: {arch}.expert_count, expert_used_count, expert_feed_forward_length (each
    # expert's intermediate size) and expert_shared_feed_forward_length (Qwen2-MoE's shared expert)
    num_experts: int = 0
    num_experts_used: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # YaRN RoPE (gpt-oss): factor, original_max_position_embeddings, beta_fast, beta_slow; written as the
    # converter's TextModel.set_gguf_parameters writes them ({arch}.rope.scaling.*)
    yarn_rope: dict | None = None

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        ffn = 3 * h * self.intermediate_size
        if self.num_experts:
            ffn = 3 * h * (self.num_experts * self.expert_intermediate_size + self.shared_expert_intermediate_size)
            ffn += h * self.num_experts  # the router
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * (attn + ffn) + embed


def add_hparams(writer, shape: DecoderShape) -> None:
    """The ``{arch}.*`` keys, as ``TextModel.set_gguf_parameters`` and its subclasses write them."""
    import gguf

    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(float(shape.rope_theta))
    writer.add_layer_norm_rms_eps(float(shape.rms_norm_eps))
    if shape.head_dim_keys:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.arch in ("llama", "granite", "smollm3", "exaone4"):  # LlamaModel's and Exaone4Model's
        writer.add_vocab_size(shape.vocab_size)
    if shape.arch in ("llama", "granite", "smollm3", "phi3"):
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.rope_linear_factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(shape.rope_linear_factor))
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    if shape.sliding_window_pattern is not None:
        writer.add_sliding_window_pattern(list(shape.sliding_window_pattern))
    if shape.rope_local_theta is not None:
        writer.add_rope_freq_base_swa(float(shape.rope_local_theta))
    if shape.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(float(shape.attn_logit_softcapping))
    if shape.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(float(shape.final_logit_softcapping))
    _add_scales(writer, shape)
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.num_experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate_size)
    if shape.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(shape.shared_expert_intermediate_size)
    if shape.yarn_rope is not None:
        _add_yarn(writer, shape.yarn_rope)


def _add_yarn(writer, rope: dict) -> None:
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if rope.get("attention_factor") is not None:
        writer.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
    writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
    writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))


def _add_scales(writer, shape: DecoderShape) -> None:
    """Granite's multipliers and Phi-3's LongRoPE keys, where the shape has them."""
    for value, add in (
        (shape.attention_scale, writer.add_attention_scale),
        (shape.embedding_scale, writer.add_embedding_scale),
        (shape.residual_scale, writer.add_residual_scale),
        (shape.logit_scale, writer.add_logit_scale),
        (shape.rope_attn_factor, writer.add_rope_scaling_attn_factors),
    ):
        if value is not None:
            add(float(value))
    if shape.rope_original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(int(shape.rope_original_context))


def llama3_rope_factors(shape: DecoderShape) -> np.ndarray:
    """The rope_freqs tensor of a Llama 3 model (``LlamaModel.generate_extra_tensors``). # [head_dim // 2]"""
    rope = shape.llama3_rope or {}
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, middle)).astype(
        np.float32
    )


def copy_tokenizer(writer, source: str | Path, vocab_size: int | None = None) -> None:
    """Copy the ``tokenizer.*`` keys (vocabulary, merges, special ids, chat template) of the GGUF
    file ``source``; ``vocab_size``, when given, must be its vocabulary's size."""
    fields = _tokenizer_fields(str(source))
    tokens = next((f for f in fields if f[0] == "tokenizer.ggml.tokens"), None)
    if tokens is None:
        raise ConfigError(f"{source}: has no tokenizer to copy (no tokenizer.ggml.tokens)")
    if vocab_size is not None and len(tokens[1]) != vocab_size:
        raise ConfigError(f"{source}: its vocabulary has {len(tokens[1])} tokens, the model {vocab_size}")
    for key, value, vtype, sub_type in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)


@functools.cache
def _tokenizer_fields(path: str) -> tuple[tuple[str, object, object, object], ...]:
    """(key, value, GGUFValueType, array item type) of each ``tokenizer.*`` key of a GGUF file.

    Read by hand, with gguf-py's constants, because ``GGUFReader`` takes 5-15 s on the embedded
    model here: it makes a numpy view of each of its ~98,000 vocabulary and merge strings, where
    this header walk takes a fraction of a second."""
    import mmap
    import struct

    from gguf import GGUF_MAGIC, GGUFValueType

    scalar = {
        GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
        GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
        GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
    }  # fmt: skip
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    at = 0

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from("<" + fmt, data, at)
        at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal at
        n = take("Q")
        at += n
        return data[at - n : at].decode("utf-8", errors="surrogateescape")

    def value(vtype):
        if vtype == GGUFValueType.STRING:
            return string()
        if vtype == GGUFValueType.ARRAY:
            item, count = GGUFValueType(take("I")), take("Q")
            if item == GGUFValueType.STRING:
                return [string() for _ in range(count)], item
            if item == GGUFValueType.ARRAY:
                raise ValueError("nested arrays")
            return list(take(f"{count}{scalar[item]}")) if count else [], item
        return take(scalar[vtype])

    if take("I") != GGUF_MAGIC:
        raise ConfigError(f"{path}: not a GGUF file")
    _version, _n_tensors, n_kv = take("I"), take("Q"), take("Q")
    fields = []
    for _ in range(n_kv):
        key, vtype = string(), GGUFValueType(take("I"))
        v = value(vtype)
        sub_type = None
        if vtype == GGUFValueType.ARRAY:
            v, sub_type = v
        if key.startswith("tokenizer."):
            fields.append((key, v, vtype, sub_type))
    data.close()
    return tuple(fields)


@dataclass
class TensorPlan:
    """One tensor to write: ``make()`` returns its data, float32/float16 for float types, else
    the GGML blocks as uint8 ``[rows, row_bytes]``."""

    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols] for a weight
    ggml_type: int  # gguf.GGMLQuantizationType
    make: Callable[[], np.ndarray] = field(repr=False)

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES

        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block * block_bytes


def write_gguf(path: str | Path, arch: str, metadata: Callable[[object], None], tensors: Sequence[TensorPlan]) -> None:
    """Write a GGUF file: ``metadata(writer)`` adds the keys, then the tensors are streamed, one
    in memory at a time (gguf-py's writer: tensor infos first, then ``write_tensor_data``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    try:
        metadata(writer)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            data = t.make()
            if data.nbytes != t.nbytes:
                raise ValueError(f"{t.name}: made {data.nbytes} bytes, planned {t.nbytes}")
            writer.write_tensor_data(data)
    finally:
        writer.close()


# ------------------------------------------------------------ a transformers model -> GGUF

# model_type -> (gguf arch, q/k rows permuted as LlamaModel.permute does, added to norm weights)
_ARCHS = {
    "llama": ("llama", True, 0.0),
    "mistral": ("llama", True, 0.0),  # LlamaModel converts MistralForCausalLM too
    "qwen2": ("qwen2", False, 0.0),
    "qwen3": ("qwen3", False, 0.0),
    "granite": ("granite", True, 0.0),  # GraniteModel(LlamaModel): q/k permuted
    "smollm3": ("smollm3", True, 0.0),  # SmolLM3Model(LlamaModel)
    "olmo2": ("olmo2", False, 0.0),
    "olmo3": ("olmo2", False, 0.0),  # llama.cpp writes OLMo 3 as olmo2 with a sliding window and its pattern
    "exaone4": ("exaone4", False, 0.0),
    "phi3": ("phi3", False, 0.0),  # fused attn_qkv, ffn_up = [gate; up]
    "gemma2": ("gemma2", False, 1.0),  # Gemma2RMSNorm scales by 1 + w; llama.cpp stores 1 + w
    "gemma3_text": ("gemma3", False, 1.0),  # likewise Gemma3RMSNorm
    "mixtral": ("llama", True, 0.0),  # llama.cpp writes Mixtral as a "llama" with experts
    "qwen2_moe": ("qwen2moe", False, 0.0),
    "qwen3_moe": ("qwen3moe", False, 0.0),
    "olmoe": ("olmoe", False, 0.0),
    "gpt_oss": ("gpt-oss", False, 0.0),
}
# What llama.cpp's graph assumes of each MoE architecture's routing (a GGUF has no key for it): whether
# the top-k weights are renormalized (norm_topk_prob); a model that differs cannot be written faithfully.
_RENORMALIZED = {"qwen2_moe": False, "qwen3_moe": True, "olmoe": False}


def _moe_fields(config) -> dict:
    """The experts' DecoderShape fields of a MoE config (none for a dense one); refuses what llama.cpp's
    file cannot say (dense layers among the sparse ones, another renormalization)."""
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if not n:
        return {}
    model_type = config.model_type
    if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) != 1:
        raise ConfigError(f"{model_type}: a GGUF file has every layer sparse (mlp_only_layers, decoder_sparse_step)")
    if model_type in _RENORMALIZED and bool(config.norm_topk_prob) != _RENORMALIZED[model_type]:
        raise ConfigError(
            f"{model_type}: llama.cpp reads norm_topk_prob={_RENORMALIZED[model_type]} for this architecture; "
            f"the model has {config.norm_topk_prob}"
        )
    return dict(
        num_experts=n,
        num_experts_used=config.num_experts_per_tok,
        # Qwen's experts are moe_intermediate_size wide (intermediate_size: its dense layers'); Mixtral's, OLMoE's the other
        expert_intermediate_size=config.moe_intermediate_size
        if model_type.startswith("qwen")
        else config.intermediate_size,
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )


def _gpt_oss_fields(config) -> dict:
    """gpt-oss's DecoderShape fields; refuses what llama.cpp's graph fixes and its file cannot say: the
    clamped SwiGLU's alpha 1.702 and limit 7.0, sliding layers the even ones, YaRN's truncation off."""
    if (config.swiglu_alpha, config.swiglu_limit) != (1.702, 7.0):
        raise ConfigError(
            f"gpt_oss: llama.cpp's graph fixes swiglu_alpha 1.702 and swiglu_limit 7.0; the model has "
            f"{config.swiglu_alpha} and {config.swiglu_limit}"
        )
    alternating = every_nth_full(config.num_hidden_layers, 2)  # the even layers sliding
    if list(config.layer_types) != alternating:
        raise ConfigError("gpt_oss: llama.cpp's file has the even layers sliding and the odd ones full (layer_types)")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    yarn = rope.get("rope_type") == "yarn"
    if yarn and rope.get("truncate", True) is not False:
        raise ConfigError("gpt_oss: llama.cpp reads gpt-oss's YaRN untruncated (truncate=False)")
    return dict(sliding_window=config.sliding_window, attn_bias=True, yarn_rope=rope if yarn else None)


def shape_of(config) -> DecoderShape:
    """A transformers config as a :class:`DecoderShape` (each dense architecture of :data:`_ARCHS`; the
    mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss)."""
    if config.model_type not in _ARCHS:
        raise ConfigError(f"cannot write a GGUF for model_type {config.model_type!r}; known: {', '.join(_ARCHS)}")
    # transformers' rope_parameters (older: rope_scaling + rope_theta), per attention type where
    # the model has two (Gemma 3: full_attention, sliding_attention), as the converter reads it.
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    full = rope.get("full_attention", rope)
    theta = full.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    local = str(rope.get("sliding_attention", {}).get("rope_type", "default")).lower()
    kind = str(full.get("rope_type", "default")).lower()
    if local != "default" or kind not in (
        "default",
        "llama3",
        "linear",
        "longrope" if config.model_type == "phi3" else "default",
        "yarn" if config.model_type == "gpt_oss" else "default",
    ):
        # written here: Llama 3's as rope_freqs, Phi-3's LongRoPE as its factors, gpt-oss's YaRN, linear; not the others
        raise ConfigError(
            f"{config.model_type}: rope type {kind!r} (local layers: {local!r}) is not written to GGUF here"
        )
    llama3 = dict(full) if str(full.get("rope_type", "")).lower() == "llama3" else None
    own = _gpt_oss_fields(config) if config.model_type == "gpt_oss" else arch_fields(config)
    return DecoderShape(
        arch=_ARCHS[config.model_type][0],
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        context_length=config.max_position_embeddings,
        rope_theta=float(theta),
        rms_norm_eps=config.rms_norm_eps,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qk_norm=config.model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe", "olmo2", "olmo3", "exaone4"),
        **({} if "attn_bias" in own else {"attn_bias": config.model_type in ("qwen2", "qwen2_moe")}),
        llama3_rope=llama3,
        rope_linear_factor=float(full["factor"]) if kind == "linear" else None,
        **_moe_fields(config),
        **own,
    )


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute``: each head's rotary halves interleaved, as llama.cpp's RoPE reads them."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _ggml_type(name: str):
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise ConfigError(f"unknown GGML type {name!r}") from None


def _quantized(data: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if qtype == GGMLQuantizationType.F32:
        return data.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    try:
        return quants.quantize(data.astype(np.float32), qtype)
    except NotImplementedError:
        raise ConfigError(
            f"gguf-py cannot quantize to {qtype.name}; use F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or MXFP4"
        ) from None


def _model_tensors(model, shape: DecoderShape) -> Iterable[tuple[str, np.ndarray]]:
    """(gguf name, float32 data) for each parameter, as ``modify_tensors`` would hand them on."""
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == shape.arch)
    names = gguf.get_tensor_name_map(arch, shape.num_layers)
    permute, norm_offset = _ARCHS[model.config.model_type][1:]
    layout = layer_parts(model.config)[0].experts_layout
    state = model.state_dict()
    if shape.tied_embeddings:
        state.pop("lm_head.weight", None)
    if shape.llama3_rope is not None:
        yield "rope_freqs.weight", llama3_rope_factors(shape)
    if shape.longrope_factors is not None:  # Phi3MiniModel.generate_extra_tensors
        for tensor, factors in zip(
            (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT), shape.longrope_factors
        ):
            yield f"{gguf.TENSOR_NAMES[tensor]}.weight", np.asarray(factors, dtype=np.float32)
    for hf_name, tensor in state.items():
        base, _, suffix = hf_name.rpartition(".")
        if suffix in _EXPERT_PARTS:  # experts [E, rows, cols] and their biases [E, rows]
            yield from _expert_tensors(names, base, suffix, tensor.detach().float().cpu().numpy(), layout)
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None and not hf_name.endswith((".weight", ".bias")):
            gguf_name += ".weight"  # a parameter of its own name (gpt-oss's sinks): the converter adds ".weight"
        if gguf_name is None:
            raise ConfigError(f"no GGUF name for {hf_name!r} in gguf-py's tensor map for {shape.arch}")
        data = tensor.detach().float().cpu().numpy()
        if permute and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_permute(data, shape.num_heads)
        elif permute and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_permute(data, shape.num_kv_heads)
        if norm_offset and hf_name.endswith("norm.weight"):
            data = data + norm_offset
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # llama.cpp's shared-expert gate is [hidden]
        yield gguf_name, data


# transformers' experts parameters -> (gguf-py's per-projection module names, the GGUF tensor's suffix)
_EXPERT_PARTS = {
    "gate_up_proj": (("gate_proj", "up_proj"), "weight"),
    "down_proj": (("down_proj",), "weight"),
    "gate_up_proj_bias": (("gate_proj", "up_proj"), "bias"),  # gpt-oss's biases [E, 2 I], [E, H]
    "down_proj_bias": (("down_proj",), "bias"),
}


def _expert_tensors(names, base: str, suffix: str, data: np.ndarray, layout: str) -> Iterable[tuple[str, np.ndarray]]:
    """transformers' 3-D experts as llama.cpp's: gate_up_proj [E, 2 I, H] -> ffn_gate_exps, ffn_up_exps
    [E, I, H]; down_proj [E, H, I] -> ffn_down_exps (gguf-py's names for ``experts.gate_proj`` ...). gpt-oss's
    ("interleaved" layout, LayerParts.experts_layout): gate_up_proj [E, H, 2 I], gate and up in alternate
    columns, down_proj [E, I, H], each transposed as the converter does; its biases ffn_*_exps.bias [E, rows]."""
    parts, kind = _EXPERT_PARTS[suffix]
    if layout == "interleaved" and len(parts) == 2:
        values = [data[..., 0::2], data[..., 1::2]]
    else:
        values = np.split(data, len(parts), axis=1 if layout == "stacked" else -1)
    for part, value in zip(parts, values):
        gguf_name = names.get_name(f"{base}.{part}")
        if gguf_name is None:
            raise ConfigError(f"no GGUF name for {base}.{part} in gguf-py's tensor map")
        if layout == "interleaved" and kind == "weight":
            value = value.swapaxes(1, 2)
        yield f"{gguf_name}.{kind}", np.ascontiguousarray(value)


def _tensor_type(name: str, data: np.ndarray, qtype, block: int):
    """As the converter does: 1-D tensors, biases (gpt-oss's experts' are 2-D), routers and rows not a whole
    number of blocks stay F32."""
    import gguf

    router = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", ".bias"))
    return qtype if data.ndim >= 2 and data.shape[-1] % block == 0 and not router else gguf.GGMLQuantizationType.F32


def export_gguf(
    model,
    path: str | Path,
    tokenizer_gguf: str | Path,
    weight_type: str = "f32",
    tensor_types: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model`` (a transformers causal LM: Llama, Qwen2, Qwen3, Gemma 3 text, Mixtral, Qwen2/3-MoE,
    OLMoE, gpt-oss) as the GGUF
    file llama.cpp's converter would write: its names and metadata, Llama's q/k rows permuted,
    2-D weights in ``weight_type`` (quantized by gguf-py: f32, f16, bf16, q8_0, q4_0, q4_1,
    q5_0, q5_1, mxfp4), 1-D tensors in F32. ``tensor_types``: another type for the 2-D weights of
    some GGUF tensor kinds, as llama-quantize's ``--tensor-type`` gives them (``{"ffn_up": "mxfp4"}``:
    every ``blk.N.ffn_up.weight``). The tokenizer keys are copied from the GGUF file
    ``tokenizer_gguf`` (e.g. the embedded SmolLM2's, 49,152 tokens: ``BUILTIN_MODELS["smollm2-135m"]
    .locate()``); its vocabulary size must be the model's."""
    import gguf

    shape = shape_of(model.config)
    types = {kind: _ggml_type(t) for kind, t in {"": weight_type, **(tensor_types or {})}.items()}
    for qtype in types.values():  # refuse a type gguf-py cannot write before writing
        _quantized(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][0]), np.float32), qtype)
    plans = []
    for name, data in _model_tensors(model, shape):
        qtype = types.get(name.split(".")[-2], types[""])
        t = _tensor_type(name, data, qtype, gguf.GGML_QUANT_SIZES[qtype][0])
        plans.append(TensorPlan(name, data.shape, t, lambda d=data, t=t: _quantized(d, t)))
    unmatched = set(tensor_types or {}) - {p.name.split(".")[-2] for p in plans}
    if unmatched:
        raise ConfigError(
            f"no tensor of kind {', '.join(sorted(unmatched))} in the model (a kind is ffn_up, attn_q, ...)"
        )
    qtype = types[""]

    def metadata(writer) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        add_hparams(writer, shape)
        file_type = getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}", gguf.LlamaFileType.ALL_F32)
        writer.add_file_type(int(file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        copy_tokenizer(writer, tokenizer_gguf, shape.vocab_size)

    write_gguf(path, shape.arch, metadata, plans)
    return Path(path)
