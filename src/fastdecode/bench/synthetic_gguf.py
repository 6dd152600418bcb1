"""Random-weight GGUF files at the shapes of real models, for benchmarks and memory tests.

Speed and memory depend on a model's shapes and weight types, not on its values, so a
benchmark at the sizes users run needs no download: ``fastdecode make-gguf --shape
llama-3.1-8b --type q4_k_m --out FILE`` writes a file with Llama-3.1-8B's trunk, the
embedded model's tokenizer (SmolLM2's 49,152 tokens, so the file loads and chats like a
real one) and random blocks in every weight. Generated on demand (seconds for a 1B file),
never committed; ``--cache-dir DIR`` keeps one file per (shape, type, seed) and writes it
once. The mixtures of experts (``olmoe-1b-7b``, ``qwen3-30b-a3b``, ``gpt-oss-20b``) are written as
llama.cpp writes them: 3-D ``ffn_{gate,up,down}_exps`` tensors in the file's type, a float32 router
(gpt-oss's biases and sinks float32 too; its rows of 2880 take the 32-wide blocks: ``--type mxfp4``).

Types: a single GGML type (``f16``, ``bf16``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``,
``q5_1``, ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``, ``iq4_nl``, ``iq4_xs``, ``mxfp4``) puts
every 2-D weight in that type (``llama-quantize --pure``, so a row measures that type's
kernel); the mixes ``q4_k_m``, ``q5_k_m`` and ``q6_k_m`` follow llama.cpp's rules
(``llama_tensor_get_type_impl`` in ``src/llama-quant.cpp``): the output matrix (the token
embedding when it is tied) in Q6_K, ``attn_v`` and ``ffn_down`` in Q6_K on the layers
``use_more_bits`` picks, the base type elsewhere. Norms are F32 ones.

The blocks are random bytes with every fp16 scale field set to a finite, normal value
(MXFP4's E8M0 scale byte to the nearest power of two) chosen so that the dequantized weights have a standard deviation of about
``1/sqrt(in_features)`` (activations keep their size through 36 layers); sub-block scales
are masked small where random bits would force a subnormal fp16 scale. Deterministic by
seed; numpy throughout, no Python loop over blocks.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import zlib
from pathlib import Path

import numpy as np

from fastdecode.errors import ConfigError
from fastdecode.formats.gguf_export import (
    DecoderShape,
    TensorPlan,
    add_hparams,
    copy_tokenizer,
    llama3_rope_factors,
    write_gguf,
)

VOCAB = 49152  # the embedded SmolLM2's tokenizer, copied into every file
_LLAMA32_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA31_ROPE = dict(_LLAMA32_ROPE, factor=8.0)

# The trunks of the models people run (their config.json), with the embedded vocabulary.
SHAPES: dict[str, DecoderShape] = {
    "llama-3.2-1b": DecoderShape(
        "llama", 2048, 16, 32, 8, 64, 8192, VOCAB, 131072, 500000.0, 1e-5, llama3_rope=_LLAMA32_ROPE
    ),
    "llama-3.2-3b": DecoderShape(
        "llama", 3072, 28, 24, 8, 128, 8192, VOCAB, 131072, 500000.0, 1e-5, llama3_rope=_LLAMA32_ROPE
    ),
    "qwen3-4b": DecoderShape("qwen3", 2560, 36, 32, 8, 128, 9728, VOCAB, 40960, 1000000.0, 1e-6, qk_norm=True),
    "llama-3.1-8b": DecoderShape(
        "llama", 4096, 32, 32, 8, 128, 14336, VOCAB, 131072, 500000.0, 1e-5, False, llama3_rope=_LLAMA31_ROPE
    ),
    # Mixtures of experts: OLMoE-1B-7B (64 experts, top 8; q and k norms over the projection) and
    # Qwen3-30B-A3B (128 experts of 768, top 8; intermediate_size 6144 is its dense layers', which it has none of)
    "olmoe-1b-7b": DecoderShape(
        "olmoe", 2048, 16, 16, 16, 128, 1024, VOCAB, 4096, 10000.0, 1e-5, False, qk_norm=True,
        num_experts=64, num_experts_used=8, expert_intermediate_size=1024,
    ),
    "qwen3-30b-a3b": DecoderShape(
        "qwen3moe", 2048, 48, 32, 4, 128, 6144, VOCAB, 40960, 1000000.0, 1e-6, False, qk_norm=True,
        num_experts=128, num_experts_used=8, expert_intermediate_size=768,
    ),
    # gpt-oss-20b (32 experts of 2880, top 4; q, k, v, o biases, sinks, a biased router and biased experts,
    # sliding window 128 on the even layers, YaRN): rows of 2880 take the 32-wide blocks (mxfp4, q8_0, q4_0 ...)
    "gpt-oss-20b": DecoderShape(
        "gpt-oss", 2880, 24, 64, 8, 64, 2880, VOCAB, 131072, 150000.0, 1e-5, False, attn_bias=True,
        sliding_window=128, num_experts=32, num_experts_used=4, expert_intermediate_size=2880,
        yarn_rope=dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0),
    ),
    # Not a real model: 4 layers of 256 (~14 MB in q4_k_m), for smoke tests of the harness.
    "tiny-llama": DecoderShape("llama", 256, 4, 4, 2, 64, 512, VOCAB, 4096, 500000.0, 1e-5),
    "tiny-qwen3-moe": DecoderShape(  # Qwen3-MoE's layout at 256, 8 experts of 256 (K-quant rows), top 2
        "qwen3moe", 256, 4, 4, 2, 64, 512, VOCAB, 4096, 1000000.0, 1e-6, False, qk_norm=True,
        num_experts=8, num_experts_used=2, expert_intermediate_size=256,
    ),
    "tiny-gpt-oss": DecoderShape(  # gpt-oss's layout at 256, 8 experts of 256, top 2, window 128
        "gpt-oss", 256, 4, 4, 2, 64, 256, VOCAB, 4096, 150000.0, 1e-5, False, attn_bias=True,
        sliding_window=128, num_experts=8, num_experts_used=2, expert_intermediate_size=256,
        yarn_rope=dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0),
    ),
}  # fmt: skip

SINGLE_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
SINGLE_TYPES += ("iq4_nl", "iq4_xs", "mxfp4")
MIXES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k", "q6_k_m": "q6_k"}  # mix -> its base type
TYPES = SINGLE_TYPES + tuple(MIXES)

# general.file_type of each type (gguf.LlamaFileType member names): a pure K type is
# written as llama.cpp's "_S" file type of that base, the nearest it has.
_FILE_TYPES = {"q2_k": "Q2_K", "q3_k": "Q3_K_S", "q4_k": "Q4_K_S", "q5_k": "Q5_K_S", "q6_k": "Q6_K"}
_FILE_TYPES |= {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k_m": "Q6_K", "mxfp4": "MXFP4_MOE"}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def weight_types(shape: DecoderShape, file_type: str) -> dict[str, str]:
    """The GGML type of every 2-D weight (gguf names) of ``shape`` in ``file_type``."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    if file_type not in TYPES:
        raise ConfigError(f"unknown type {file_type!r}; known: {', '.join(TYPES)}")
    base = MIXES.get(file_type, file_type)
    per_layer = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V, MODEL_TENSOR.ATTN_OUT)
    per_layer += _ffn_tensors(shape)
    types = {TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD]: base}
    for i in range(shape.num_layers):
        more = file_type in MIXES and use_more_bits(i, shape.num_layers)
        for t in per_layer:
            # llama.cpp matches "ffn_down" in the name: the experts' down tensor too
            bump = more and t in (MODEL_TENSOR.ATTN_V, MODEL_TENSOR.FFN_DOWN, MODEL_TENSOR.FFN_DOWN_EXP)
            types[TENSOR_NAMES[t].format(bid=i)] = "q6_k" if bump else base
    output = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD if shape.tied_embeddings else MODEL_TENSOR.OUTPUT]
    types[output] = "q6_k" if file_type in MIXES else base
    return {f"{name}.weight": t for name, t in types.items()}


def _ffn_tensors(shape: DecoderShape) -> tuple:
    """The FFN's weights of a layer: gate, up, down, or the experts' 3-D ones (the router is float32 apart)."""
    from gguf import MODEL_TENSOR

    if shape.num_experts:
        return (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP)
    return (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)


def _weight_shape(shape: DecoderShape, name: str) -> tuple[int, ...]:
    """[out_features, in_features] of a weight named as in gguf (``blk.N.attn_q.weight``); the experts'
    [n_expert, out_features, in_features]."""
    h, d, ffn = shape.hidden_size, shape.head_dim, shape.intermediate_size
    n, e_ffn = shape.num_experts, shape.expert_intermediate_size
    kind = name.split(".")[-2]
    return {
        "ffn_gate_exps": (n, e_ffn, h),
        "ffn_up_exps": (n, e_ffn, h),
        "ffn_down_exps": (n, h, e_ffn),
        "token_embd": (shape.vocab_size, h),
        "output": (shape.vocab_size, h),
        "attn_q": (shape.num_heads * d, h),
        "attn_k": (shape.num_kv_heads * d, h),
        "attn_v": (shape.num_kv_heads * d, h),
        "attn_output": (h, shape.num_heads * d),
        "ffn_gate": (ffn, h),
        "ffn_up": (ffn, h),
        "ffn_down": (h, ffn),
    }[kind]


# ------------------------------------------------------------------ random blocks

# Per block type: the byte offset of its fp16 scale d; (offset, value / d) of its fp16 min
# field, set so that the weights centre near 0; (offset, length, and-mask, or-mask) byte
# ranges that keep sub-block scales small (gguf-py's dequantize_blocks give the layouts).
_LAYOUTS: dict[str, tuple[int, tuple[int, float] | None, tuple[tuple[int, int, int, int], ...]]] = {
    "q8_0": (0, None, ()),
    "q4_0": (0, None, ()),
    "q4_1": (0, (2, -8.0), ()),  # w = d*q + m, q in 0..15
    "q5_0": (0, None, ()),
    "q5_1": (0, (2, -16.0), ()),
    "iq4_nl": (0, None, ()),
    "q2_k": (80, (82, 1.5), ()),  # w = d*sc*q - dmin*m: q in 0..3, sc and m in 0..15
    "q3_k": (108, None, ()),
    "q4_k": (0, (2, 7.5), ((4, 8, 0x0F, 0),)),  # 6-bit sc and m kept in 0..15
    "q5_k": (0, (2, 15.5), ((4, 8, 0x0F, 0),)),
    "q6_k": (208, None, ((192, 16, 0x07, 0),)),  # int8 sub-scales kept in 0..7
    "iq4_xs": (0, None, ((2, 2, 0, 0xAA), (4, 4, 0x33, 0))),  # 6-bit scales - 32 kept in 0..3
}
_E8M0_SCALE_AT = {"mxfp4": 0}  # the byte of an E8M0 scale e (weights 2^(e - 128) times the levels), not an fp16 d
_MIN_NORMAL_F16 = 2.0**-14


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


def _raw_blocks(qtype: str, n_blocks: int, rng: np.random.Generator, d: float) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` with the scale d (and its min) set. # [n_blocks, block_bytes]"""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype.upper()]][1]
    blocks = _random_bytes(rng, n_blocks * block_bytes).reshape(n_blocks, block_bytes)
    if qtype in _E8M0_SCALE_AT:  # d as the nearest power of two
        blocks[:, _E8M0_SCALE_AT[qtype]] = min(max(128 + round(math.log2(d)), 2), 254)
        return blocks
    d_at, min_field, masks = _LAYOUTS[qtype]
    for at, length, and_mask, or_mask in masks:
        blocks[:, at : at + length] &= np.uint8(and_mask)
        blocks[:, at : at + length] |= np.uint8(or_mask)
    blocks[:, d_at : d_at + 2] = np.array([d], np.float16).view(np.uint8)
    if min_field is not None:
        at, ratio = min_field
        blocks[:, at : at + 2] = np.array([d * ratio], np.float16).view(np.uint8)
    return blocks


@functools.cache
def _unit_rms(qtype: str) -> float:
    """The RMS of ``qtype``'s dequantized weights with d = 1 over random blocks (gguf-py's dequantizer)."""
    from gguf import GGMLQuantizationType, quants

    blocks = _raw_blocks(qtype, 512, np.random.default_rng(0), 1.0)
    return float(np.sqrt(np.mean(quants.dequantize(blocks, GGMLQuantizationType[qtype.upper()]) ** 2)))


def random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A random ``[rows, cols]`` weight in ``qtype`` with a standard deviation near
    ``1/sqrt(cols)``: uint16 bit patterns for f16/bf16, else uint8 blocks ``[rows, row_bytes]``."""
    std = 1.0 / math.sqrt(cols)
    if qtype in ("f16", "bf16"):
        # Random sign and mantissa under one exponent: |w| in [2^e, 2^(e+1)), RMS ~1.5 * 2^e.
        e = round(math.log2(std / 1.5))
        mant_bits, bias = (10, 15) if qtype == "f16" else (7, 127)
        bits = _random_bytes(rng, rows * cols * 2).view(np.uint16).reshape(rows, cols)
        bits &= np.uint16(0x8000 | ((1 << mant_bits) - 1))
        bits |= np.uint16((e + bias) << mant_bits)
        return bits
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype.upper()]][0]
    if cols % block:
        raise ConfigError(f"{qtype} needs rows of a multiple of {block} weights, got {cols}")
    d = max(std / _unit_rms(qtype), _MIN_NORMAL_F16)
    return _raw_blocks(qtype, rows * cols // block, rng, d).reshape(rows, -1)


# ------------------------------------------------------------------ the file


def _plans(shape: DecoderShape, file_type: str, seed: int) -> list[TensorPlan]:
    from gguf import MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType

    def rng(name: str) -> np.random.Generator:  # one stream per tensor: any order, same bytes
        return np.random.default_rng([seed, zlib.crc32(name.encode())])

    def ones(name: str, n: int) -> TensorPlan:
        return TensorPlan(name, (n,), GGMLQuantizationType.F32, lambda: np.ones(n, np.float32))

    types = weight_types(shape, file_type)

    def weight(name: str) -> TensorPlan:
        dims, qtype = _weight_shape(shape, name), types[name]
        rows, cols = math.prod(dims[:-1]), dims[-1]  # experts: each a run of rows
        return TensorPlan(
            name, dims, GGMLQuantizationType[qtype.upper()], lambda: random_weight(qtype, rows, cols, rng(name))
        )

    def router(name: str) -> TensorPlan:  # float32 [n_expert, hidden], as llama.cpp keeps it
        dims = (shape.num_experts, shape.hidden_size)
        make = lambda: (rng(name).standard_normal(dims) / math.sqrt(dims[1])).astype(np.float32)  # noqa: E731
        return TensorPlan(name, dims, GGMLQuantizationType.F32, make)

    def name(tensor, i: int | None = None) -> str:
        return TENSOR_NAMES[tensor].format(bid=i) + ".weight"

    plans = [weight(name(MODEL_TENSOR.TOKEN_EMBD))]
    if shape.llama3_rope is not None:
        factors = llama3_rope_factors(shape)
        plans.append(
            TensorPlan(name(MODEL_TENSOR.ROPE_FREQS), factors.shape, GGMLQuantizationType.F32, lambda: factors)
        )
    for i in range(shape.num_layers):
        plans.append(ones(name(MODEL_TENSOR.ATTN_NORM, i), shape.hidden_size))
        for t in (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V, MODEL_TENSOR.ATTN_OUT):
            plans.append(weight(name(t, i)))
        if shape.qk_norm:
            plans += _qk_norms(shape, [name(t, i) for t in (MODEL_TENSOR.ATTN_Q_NORM, MODEL_TENSOR.ATTN_K_NORM)], ones)
        gpt_oss = shape.arch == "gpt-oss"  # its FFN norm is named post_attention_norm
        plans.append(
            ones(name(MODEL_TENSOR.ATTN_POST_NORM if gpt_oss else MODEL_TENSOR.FFN_NORM, i), shape.hidden_size)
        )
        if shape.num_experts:
            plans.append(router(name(MODEL_TENSOR.FFN_GATE_INP, i)))
        for t in _ffn_tensors(shape):
            plans.append(weight(name(t, i)))
        if gpt_oss:
            plans += _gpt_oss_small(shape, i, rng)
    plans.append(ones(name(MODEL_TENSOR.OUTPUT_NORM), shape.hidden_size))
    if not shape.tied_embeddings:
        plans.append(weight(name(MODEL_TENSOR.OUTPUT)))
    return plans


def _gpt_oss_small(shape: DecoderShape, i: int, rng) -> list[TensorPlan]:
    """gpt-oss's small float32 tensors of layer ``i``, random near zero: the q, k, v and o biases, the heads'
    sinks, the router's bias and the experts' biases ([n_expert, rows], as llama.cpp's converter writes them)."""
    from gguf import GGMLQuantizationType

    h, n, e_ffn = shape.hidden_size, shape.num_experts, shape.expert_intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    dims = {
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.bias": (h,),
        "attn_sinks.weight": (shape.num_heads,), "ffn_gate_inp.bias": (n,),
        "ffn_gate_exps.bias": (n, e_ffn), "ffn_up_exps.bias": (n, e_ffn), "ffn_down_exps.bias": (n, h),
    }  # fmt: skip

    def small(name: str, shape_: tuple[int, ...]) -> TensorPlan:
        make = lambda: (0.02 * rng(name).standard_normal(shape_)).astype(np.float32)  # noqa: E731
        return TensorPlan(name, shape_, GGMLQuantizationType.F32, make)

    return [small(f"blk.{i}.{kind}", d) for kind, d in dims.items()]


def _qk_norms(shape: DecoderShape, names: list[str], ones) -> list[TensorPlan]:
    """Query and key norms: per head ([head_dim]), or OLMoE's over the whole projections ([H * D], [KV * D])."""
    if shape.arch != "olmoe":
        return [ones(n, shape.head_dim) for n in names]
    return [ones(names[0], shape.num_heads * shape.head_dim), ones(names[1], shape.num_kv_heads * shape.head_dim)]


def write_synthetic_gguf(
    path: str | Path, shape: DecoderShape | str, file_type: str, seed: int = 0, label: str | None = None
) -> Path:
    """Write a random-weight GGUF of ``shape`` (a :class:`DecoderShape` or a name in :data:`SHAPES`)
    in ``file_type`` (one of :data:`TYPES`) to ``path``, with the embedded model's tokenizer."""
    import gguf

    from fastdecode.loading import BUILTIN_MODELS

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ConfigError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        label, shape = label or shape, SHAPES[shape]
    plans = _plans(shape, file_type, seed)
    file_type_name = _FILE_TYPES.get(file_type, file_type.upper())

    def metadata(writer) -> None:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(f"synthetic {label or shape.arch} {file_type} (random weights, seed {seed})")
        add_hparams(writer, shape)
        writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{file_type_name}"]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        copy_tokenizer(writer, BUILTIN_MODELS["smollm2-135m"].locate(), shape.vocab_size)

    write_gguf(path, shape.arch, metadata, plans)
    return Path(path)


def synthetic_gguf(shape: str, file_type: str, cache_dir: str | Path, seed: int = 0) -> Path:
    """The file of (shape, type, seed) under ``cache_dir``, written on the first call only."""
    cache_dir = Path(cache_dir)
    path = cache_dir / f"{shape}-{file_type}-seed{seed}.gguf"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_synthetic_gguf(tmp, shape, file_type, seed)
        tmp.rename(path)  # atomic: a reader never sees half a file
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------ command line


def add_make_gguf_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "make-gguf",
        help="write a random-weight GGUF at a real model's shape (for benchmarks and memory tests)",
        description=" ".join(__doc__.split("\n\n")[1].split()),
    )
    _add_args(p)
    p.set_defaults(func=cmd_make_gguf)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, choices=list(SHAPES), help="the model whose trunk the file has")
    p.add_argument("--type", required=True, choices=list(TYPES), dest="file_type", help="weight type or mix")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="write this file (replaced if it exists)")
    where.add_argument("--cache-dir", help="write <shape>-<type>-seed<seed>.gguf here once; later calls reuse it")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")


def cmd_make_gguf(args: argparse.Namespace) -> int:
    if args.out is not None:
        path = write_synthetic_gguf(args.out, args.shape, args.file_type, args.seed)
    else:
        path = synthetic_gguf(args.shape, args.file_type, args.cache_dir, args.seed)
    print(f"{path}\t{path.stat().st_size / 2**30:.2f} GiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastdecode.bench.synthetic_gguf", description=__doc__)
    _add_args(parser)
    try:
        return cmd_make_gguf(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
