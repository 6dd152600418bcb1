"""The C library's interface, declared once: every exported function of ``cpu.c``,
``quant.c``, ``quant_pack.c``, ``w8a8.c`` and ``experts.c`` with its arguments named as in the C source, the structures Python fills
for it, and the constants both sides share.

:func:`bind` builds the ctypes signatures from these tables, and a test
(``tests/kernels/test_abi.py``, ``test_quant_blocks.py``) checks them against the C
source, so the two cannot drift apart.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

I64, PTR, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
CFunctions = dict[str, tuple[type | None, list[tuple[str, type]]]]  # name -> (result, [(argument, type)])

_PAGED = [("B", I64), ("pos", PTR), ("seq", PTR), ("tables", PTR), ("max_blocks", I64)]  # PagedRows.args()
_KV_TYPES = [("k_type", I64), ("v_type", I64)]  # the K and V pools' KV_FORMATS codes

# cpu.c's exported functions.
CPU_FUNCTIONS: CFunctions = {
    "fd_rowgemm_f32": (None, [("x", PTR), ("M", I64), ("K", I64), ("w", PTR), ("N", I64), ("y", PTR)]),
    "fd_rowgemm_i8": (None, [("x", PTR), ("M", I64), ("K", I64), ("q", PTR), ("scale", PTR), ("N", I64), ("y", PTR)]),
    "fd_attention_f32": (
        None,
        [
            ("q", PTR),
            ("q_row_stride", I64),
            ("q_head_stride", I64),
            ("n", I64),
            ("H", I64),
            ("KV", I64),
            ("D", I64),
            ("k", PTR),
            ("v", PTR),
            *_PAGED,
            ("scale", F32),
            ("window", I64),
            ("scratch", PTR),
            ("out", PTR),
            *_KV_TYPES,
            ("impl", I64),
            ("k_affine", PTR),
            ("softcap", F32),
            ("sinks", PTR),
        ],
    ),
    "fd_rmsnorm_f32": (None, [("x", PTR), ("n", I64), ("dim", I64), ("weight", PTR), ("eps", F32), ("out", PTR)]),
    "fd_head_rmsnorm_f32": (
        None,
        [("x", PTR), ("n", I64), ("row_stride", I64), ("heads", I64), ("dim", I64), ("weight", PTR), ("eps", F32)],
    ),
    "fd_rope_qkv_f32": (
        None,
        [
            ("qkv", PTR),
            ("n", I64),
            ("H", I64),
            ("KV", I64),
            ("D", I64),
            ("cos", PTR),
            ("sin", PTR),
            ("q_out", PTR),
            ("k", PTR),
            ("v", PTR),
            *_PAGED,
            *_KV_TYPES,
            ("k_affine", PTR),
        ],
    ),
    "fd_kv_mirror": (
        None,
        [("k", PTR), ("v", PTR), ("KV", I64), ("D", I64), *_PAGED, ("mirrors", PTR), ("m", I64), *_KV_TYPES],
    ),
    "fd_kv_store_feedback": (
        None,
        [("x", PTR), ("n", I64), ("D", I64), ("T", I64), ("A", PTR), ("index", PTR), ("out", PTR)],
    ),
    "fd_glu_f32": (None, [("gate_up", PTR), ("n", I64), ("inter", I64), ("act", I64), ("out", PTR)]),
    "fd_glu_clamped_f32": (
        None,
        [("gate_up", PTR), ("n", I64), ("inter", I64), ("alpha", F32), ("limit", F32), ("out", PTR)],
    ),
    "fd_layer_ffn_floats": (I64, [("L", PTR), ("n", I64)]),
    "fd_layer_stack": (
        None,
        [
            ("x", PTR),
            ("n", I64),
            ("hidden", I64),
            ("layers", PTR),
            ("n_layers", I64),
            ("cos", PTR),
            ("sin", PTR),
            ("k", PTR),
            ("v", PTR),
            *_PAGED,
            ("scale", F32),
            ("work", PTR),
            *_KV_TYPES,
            ("mirrors", PTR),
            ("n_mirrors", I64),
            ("k_affine", PTR),
        ],
    ),
}

# quant.c's exported functions.
QUANT_FUNCTIONS: CFunctions = {
    "fd_qact_bytes": (I64, [("M", I64), ("K", I64)]),
    "fd_quantize_rows": (None, [("x", PTR), ("M", I64), ("K", I64), ("impl", I64), ("buf", PTR)]),
    "fd_project_scratch_bytes": (I64, [("p", PTR), ("M", I64), ("K", I64)]),
    "fd_project": (None, [("x", PTR), ("M", I64), ("K", I64), ("p", PTR), ("scratch", PTR), ("y", PTR)]),
    "fd_impl_supported": (I64, [("impl", I64)]),
}

# quant_pack.c's exported functions: stored GGUF blocks into quant.c's layout (kernels/quant_pack.py's pack).
PACK_FUNCTIONS: CFunctions = {
    "fd_pack_bytes": (I64, [("fmt", I64), ("rows", I64), ("K", I64)]),
    "fd_pack_blocks": (
        I64,
        [
            ("fmt", I64),
            ("K", I64),
            ("src", PTR),
            ("src_rows", PTR),
            ("src_stride", PTR),
            ("n_src", I64),
            ("order", PTR),
            ("rows", I64),
            ("out", PTR),
        ],
    ),
}

# w8a8.c's exported functions (its GEMM is reached through fd_project).
W8A8_FUNCTIONS: CFunctions = {
    "fd_w8a8_act_bytes": (I64, [("M", I64), ("K", I64)]),
    "fd_w8a8_quantize_rows": (None, [("x", PTR), ("M", I64), ("K", I64), ("impl", I64), ("buf", PTR)]),
}


# experts.c's exported functions: a mixture of experts' FFN in one call (kernels/experts.py).
EXPERTS_FUNCTIONS: CFunctions = {
    "fd_experts_work_bytes": (I64, [("E", PTR), ("n", I64), ("k", I64)]),
    "fd_moe_work_floats": (I64, [("M", PTR), ("n", I64)]),
    "fd_route_f32": (
        None,
        [
            ("logits", PTR),
            ("n", I64),
            ("E", I64),
            ("k", I64),
            ("routing", I64),
            ("renormalize", I64),
            ("weight", PTR),
            ("index", PTR),
        ],
    ),
    "fd_experts": (
        I64,
        [
            ("E", PTR),
            ("x", PTR),
            ("n", I64),
            ("k", I64),
            ("index", PTR),
            ("weight", PTR),
            ("work", PTR),
            ("out", PTR),
        ],
    ),
}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with every function of :data:`CPU_FUNCTIONS`, :data:`QUANT_FUNCTIONS`,
    :data:`PACK_FUNCTIONS`, :data:`W8A8_FUNCTIONS` and :data:`EXPERTS_FUNCTIONS` typed."""
    for table in (CPU_FUNCTIONS, QUANT_FUNCTIONS, PACK_FUNCTIONS, W8A8_FUNCTIONS, EXPERTS_FUNCTIONS):
        for name, (restype, args) in table.items():
            fn = getattr(lib, name)
            fn.argtypes = [t for _, t in args]
            fn.restype = restype
    return lib


MAX_HEAD_DIM = 256  # cpu.c's MAX_HEAD_DIM
GLU_ACTIVATIONS = ("silu", "gelu_tanh")  # cpu.c's ACT_SILU = 0, ACT_GELU_TANH = 1
EXPERTS_CLAMPED = 2  # experts.c's EX_ACT_CLAMPED: gpt-oss's clamped SwiGLU (fd_glu_clamped_f32), alpha and limit
# cpu.c's FFN_*: what a layer's ffn points at (gated: the gated MLP, CGatedMLP; none: no FFN, the layer's
# attention half, its FFN's input left in the work for the caller: a mixture of experts' layer)
# experts: a mixture of experts without a shared expert, router and experts in C (experts.c's fd_moe_ffn, CMoE)
FFN_KINDS = ("gated", "none", "experts")
# experts.c's ROUTE_*: softmax over every expert then its top k, or the top k logits then their softmax
ROUTINGS = ("softmax_topk", "topk_softmax")
MAX_TOP_K = 64  # experts.c's EX_MAX_TOP_K: the most experts a row is routed to
# a layer's query and key norms: each head's vector, or the whole projection (fd_layer_desc's qk_norm_whole)
QK_NORMS = ("head", "proj")
# quant.c's FD_W_*; s24_q8: 2:4 sparse Q8_0 (sparse.c); w8a8: int8 per channel x int8 per token (w8a8.c);
# s24_f32: 2:4 sparse float32 (sparse_f32.c); bf16, f16: 16-bit float weights on cpu.c's float GEMM
WEIGHT_FORMATS = {
    "f32": 0,
    "i8": 1,
    "q8_0": 2,
    "q4_0": 3,
    "q4_1": 4,
    "q4_k": 5,
    "q6_k": 6,
    "s24_q8": 7,
    "w8a8": 8,
    "s24_f32": 9,
    "q5_0": 10,
    "q5_1": 11,
    "q5_k": 12,
    "q3_k": 13,
    "q2_k": 14,
    "iq4_nl": 15,
    "iq4_xs": 16,
    "bf16": 17,
    "f16": 18,
    "mxfp4": 19,
}
# the formats of an expert's projections on experts.c (quant.c's block GEMM, activations per block of 32)
EXPERT_FORMATS = tuple(f for f in WEIGHT_FORMATS if f not in ("f32", "i8", "s24_q8", "w8a8", "s24_f32", "bf16", "f16"))
# packed formats fd_project runs on the float GEMM: a projection's only part (bf16, f16: 16-bit weights
# widened in registers, the float32 GEMM's bits; f32: a float32 weight as PackedBlocks)
ALONE_FORMATS = ("s24_f32", "bf16", "f16", "f32")
IMPLS = {"auto": -1, "avx2": 0, "scalar": 1, "avx512_vnni": 2, "avx_vnni": 3}  # quant.c's FD_IMPL_*
MAX_PARTS = 4  # quant.c's FD_MAX_PARTS
GROUP = 8  # quant.c's QGROUP
KV_FORMATS = {"float32": 0, "float16": 1, "q8_0": 2, "q4_0": 3}  # kv.c's KV_F32, KV_F16, KV_Q8_0, KV_Q4_0
KV_ROTATED = 4  # kv.c's KV_ROTATED: a flag on a quantized type, its rows stored Hadamard-rotated


class CPart(ctypes.Structure):
    """quant.c's fd_part."""

    _fields_ = [("fmt", I64), ("n", I64), ("w", PTR), ("scale", PTR)]


class CProj(ctypes.Structure):
    """quant.c's fd_proj."""

    _fields_ = [("n_parts", I64), ("part", CPart * MAX_PARTS), ("bias", PTR), ("impl", I64)]


class CGatedMLP(ctypes.Structure):
    """cpu.c's fd_gated_mlp: the FFN of kind ``gated`` (down(act(gate) * up), gate and up one projection)."""

    _fields_ = [("gate_up", PTR), ("down", PTR), ("inter", I64), ("act", I64)]


class CExperts(ctypes.Structure):
    """experts.c's fd_experts_desc: per expert, gate and up as one projection and down (arrays of
    ``CProj`` pointers, each with its bias or none), the shape, the activation (:data:`GLU_ACTIVATIONS`, or
    :data:`EXPERTS_CLAMPED` with ``alpha`` and ``limit``) and the implementation."""

    _fields_ = [("gate_up", PTR), ("down", PTR)]
    _fields_ += [(name, I64) for name in ("n_experts", "hidden", "inter", "act", "impl")]
    _fields_ += [("alpha", F32), ("limit", F32)]


class CMoE(ctypes.Structure):
    """experts.c's fd_moe_ffn: a layer's router (a float32 ``CProj``), its experts (``CExperts``), the
    routing (top_k, :data:`ROUTINGS` index, renormalize) and a counter of the experts run (int64, or NULL)."""

    _fields_ = [("router", PTR), ("experts", PTR)]
    _fields_ += [(name, I64) for name in ("top_k", "routing", "renormalize")]
    _fields_ += [("runs", PTR)]


class CLayerDesc(ctypes.Structure):
    """cpu.c's fd_layer_desc: a decoder layer's weights (pointers, held by its
    ``DecoderLayerKernel``; NULL where the layer has no such part) and shape."""

    _fields_ = [(name, PTR) for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "qkv", "o")]
    _fields_ += [(name, PTR) for name in ("q_norm", "k_norm", "sinks", "ffn")]
    _fields_ += [(name, I64) for name in ("H", "KV", "D", "qk_norm_whole", "window", "ffn_kind")]
    _fields_ += [("eps", F32), ("residual_scale", F32), ("softcap", F32)]


@dataclass(frozen=True)
class PackedBlocks:
    """A ``BlockTensor`` in ``quant.c``'s layout (``quant_pack.py``'s pack): ceil(rows / 8) groups,
    each its blocks in units (pairs, MXFP4's fours; a super-block), a unit its scales (d[8] fp16, and
    m[8] fp16 for Q4_1 / Q5_1, a block; MXFP4's e[8] E8M0 bytes; for a super-block format the
    super-block's stored scales, padded to a multiple of 32 bytes) then its quants (the eight rows'
    interleaved four bytes at a time, in bit planes); or, by ``format``, 2:4 sparse Q8_0 in ``sparse.c``'s layout (``s24_q8``) or W8A8 weights in ``w8a8.c``'s (``w8a8``: a group's
    float32 scales, then its int8 rows interleaved four bytes at a time). data: uint8, 64-byte aligned."""

    format: str
    rows: int
    cols: int
    data: torch.Tensor
