"""ggml's tensor types as fastdecode reads them from a GGUF file: each type's block layout
(:class:`BlockFormat`), the integers and scales its blocks hold (:func:`unpack_fields`,
:func:`unpack_scales`), and how fastdecode runs it (:data:`GGUF_TYPES`).

Every block type is read as blocks of 32 weights, ``weight = d * q (+ m)``: q an integer,
d and m the scales ggml dequantizes with (the file's fp16, or the float32 products ggml
forms from a super-block's stored scales), so ``d * q + m`` in float32 is the very value
``gguf.quants.dequantize`` gives. Per block of 32 (a K-quant's super-block of 256 holds 8)::

    type     q the scale multiplies           d (a block)              m
    Q8_0     int8                              fp16 d                   -
    Q4_0     0..15, less 8                     fp16 d                   -
    Q4_1     0..15                             fp16 d                   fp16 m
    Q5_0     0..31, less 16                    fp16 d                   -
    Q5_1     0..31                             fp16 d                   fp16 m
    IQ4_NL   int8 codebook value (16 levels)   fp16 d                   -
    Q2_K     0..3                              d * sc, one a 16         -(dmin * m), one a 16
    Q3_K     -4..3                             d * (sc - 32), one a 16  -
    Q4_K     0..15                             d * sc                   -(dmin * m)
    Q5_K     0..31                             d * sc                   -(dmin * m)
    Q6_K     -32..31                           d * sc, one a 16         -
    IQ4_XS   int8 codebook value               d * (sc - 32)            -
    MXFP4    int8 E2M1 value, doubled          float32 2^(e - 128)      -

(MXFP4's scale is an E8M0 byte e; ggml halves it to take the doubled E2M1 values: ggml-impl.h's
``GGML_E8M0_TO_FP32_HALF``, exact in float32 for every e, 0 and 1 subnormal.)

(x - y and x + (-y) are the same float32 operation, so ggml's ``d * q - dm`` is ``d * q + m``.)
F32, F16 and BF16 tensors are float weights (:func:`widen` gives them exactly as float32).

How each runs (:data:`GGUF_TYPES`): every type natively. A block type on integer dot-product
kernels that read its packed bits (``fastdecode.kernels.quant``: the blocks repacked once, at
load, into groups of eight outputs, same bits a weight as the file up to the padding of a
super-block's scales: the bytes a weight of both are in the table); a float type on the
row-invariant float GEMM, F16 and BF16 kept 16-bit and widened a vector at a time in
registers (exact: the bits the float32 GEMM gives over the widened weight).

This module reads bytes only (numpy); :class:`fastdecode.kernels.gguf_blocks.BlockTensor` holds a
tensor in one of these formats and :func:`fastdecode.kernels.gguf_blocks.file_blocks` makes one from a
file's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block
QK_K = 256  # weights per K-quant super-block

# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h's kvalues_iq4nl), ascending
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# MXFP4's 16 levels (ggml-common.h's kvalues_mxfp4): E2M1's values doubled, indexed by a nibble (8: -0)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType
    block_bytes: int  # bytes of one stored block (a K-quant's super-block; a float type's one weight)
    has_min: bool  # an m a block: Q4_1's, Q5_1's, the K-quants' -(dmin * m)
    nibbles: bool  # 4-bit quants, two to a byte (Q4_K's and IQ4_XS's in an order of their own)
    block_weights: int = QK  # weights of one stored block: 32, a K-quant's 256, a float type's 1
    scales_per_block: int = 1  # scales per block of 32: Q2_K, Q3_K and Q6_K have one per 16 weights
    q_offset: int = 0  # subtracted from q before the scale: Q4_0's 8, Q5_0's 16

    @property
    def k_quant(self) -> bool:
        return self.block_weights == QK_K

    @property
    def is_float(self) -> bool:
        return self.block_weights == 1


_ALL = (
    BlockFormat("q8_0", 8, 2 + QK, False, False),
    BlockFormat("q4_0", 2, 2 + QK // 2, False, True, q_offset=8),
    BlockFormat("q4_1", 3, 4 + QK // 2, True, True),
    BlockFormat("q5_0", 6, 2 + 4 + QK // 2, False, False, q_offset=16),
    BlockFormat("q5_1", 7, 4 + 4 + QK // 2, True, False),
    BlockFormat("iq4_nl", 20, 2 + QK // 2, False, True),
    BlockFormat("mxfp4", 39, 1 + QK // 2, False, True),
    BlockFormat("q2_k", 10, QK_K // 16 + QK_K // 4 + 4, True, False, QK_K, 2),
    BlockFormat("q3_k", 11, QK_K // 8 + QK_K // 4 + 12 + 2, False, False, QK_K, 2),
    BlockFormat("q4_k", 12, 4 + 12 + QK_K // 2, True, True, QK_K),
    BlockFormat("q5_k", 13, 4 + 12 + QK_K // 8 + QK_K // 2, True, False, QK_K),
    BlockFormat("q6_k", 14, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, False, False, QK_K, 2),
    BlockFormat("iq4_xs", 23, 2 + 2 + QK_K // 64 + QK_K // 2, False, True, QK_K),
    BlockFormat("f32", 0, 4, False, False, 1),
    BlockFormat("f16", 1, 2, False, False, 1),
    BlockFormat("bf16", 30, 2, False, False, 1),
)
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in _ALL}


@dataclass(frozen=True)
class GGUFType:
    """How fastdecode runs one ggml tensor type: ``route`` says whether a native kernel reads its
    bits or it is converted at load (exactly), and the bytes a weight it costs in the file and as
    the kernels hold it (groups of eight whole rows; a legacy type's odd last block pads to a pair)."""

    format: BlockFormat
    route: str
    file_bytes_per_weight: float
    packed_bytes_per_weight: float


def _native(name: str, packed: float) -> GGUFType:
    f = BLOCK_FORMATS[name]
    return GGUFType(f, "native", f.block_bytes / f.block_weights, packed)


# packed bytes: a group of 8 rows' (unit scales + quants) / its weights (kernels/quant.c's layout)
GGUF_TYPES: dict[int, GGUFType] = {
    t.format.ggml_type: t
    for t in (
        _native("f32", 4.0),  # the float GEMM's own weights: the file's float32 as they are
        _native("f16", 2.0),  # the float GEMM widening each weight vector in registers (its float32 bits)
        _native("bf16", 2.0),
        _native("q8_0", (16 + 256) / 256),  # 1.0625: d[8] + int8 quants
        _native("q4_0", (16 + 128) / 256),  # 0.5625: d[8] + nibbles
        _native("q4_1", (32 + 128) / 256),  # 0.625: d[8], m[8] + nibbles
        _native("q5_0", (16 + 160) / 256),  # 0.6875: d[8] + nibbles + a bit plane
        _native("q5_1", (32 + 160) / 256),  # 0.75
        _native("iq4_nl", (16 + 128) / 256),  # 0.5625: nibbles indexing the codebook
        _native("mxfp4", (32 + 4 * 128) / 1024),  # 0.53125: e[8] a block, four blocks a unit; nibbles
        _native("q2_k", (160 + 8 * 64) / 2048),  # 0.328125: d, dmin, 4-bit sc|m a 16; two bit planes
        _native("q3_k", (160 + 8 * 96) / 2048),  # 0.453125: d, int8 sc a 16 (144 -> 160 bytes); three planes
        _native("q4_k", (160 + 8 * 128) / 2048),  # 0.578125: d, dmin, sc[8], m[8]; nibbles
        _native("q5_k", (160 + 8 * 160) / 2048),  # 0.703125
        _native("q6_k", (160 + 8 * 192) / 2048),  # 0.828125: d, int8 sc a 16 (144 -> 160); nibbles + 2 planes
        _native("iq4_xs", (96 + 8 * 128) / 2048),  # 0.546875: d, int8 sc[8] (80 -> 96 bytes); nibbles
    )
}


def type_name(ggml_type: int) -> str:
    """ggml's name of a tensor type (``Q4_K``), or its number where gguf-py knows no such type."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


def gguf_type(ggml_type: int) -> GGUFType:
    """The type's entry in :data:`GGUF_TYPES`; a ValueError naming it when fastdecode does not run it."""
    entry = GGUF_TYPES.get(int(ggml_type))
    if entry is None:
        runs = ", ".join(t.format.name.upper() for t in GGUF_TYPES.values())
        raise ValueError(f"GGUF tensor type {type_name(ggml_type)} is not supported; fastdecode runs {runs}")
    return entry


def row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of ``cols`` weights of ``ggml_type`` in a GGUF file (cols a whole number of blocks)."""
    f = gguf_type(ggml_type).format
    if cols % f.block_weights:
        raise ValueError(f"{f.name}: a row is whole blocks of {f.block_weights} weights, not {cols}")
    return cols // f.block_weights * f.block_bytes


# -- unpacking: b is a tensor's stored blocks, uint8 [rows, n, block_bytes] -------------------


@dataclass(frozen=True)
class KScales:
    """A super-block type's scales as stored, [rows, n_super] each: ``d`` (and ``dmin``) fp16;
    ``sc`` and ``m`` one a sub-block: Q4_K's / Q5_K's 6-bit uint8 [.., 8] each; Q2_K's 4-bit uint8
    [.., 16] each (one a 16 weights); Q3_K's (sc - 32) and Q6_K's int8 sc [.., 16], IQ4_XS's
    (sc - 32) int8 [.., 8], their ``dmin`` and ``m`` None."""

    d: np.ndarray
    dmin: np.ndarray | None
    sc: np.ndarray
    m: np.ndarray | None


Fields = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(b: np.ndarray, at: int) -> np.ndarray:  # the fp16 at byte ``at`` of every block: [rows, n]
    return b[..., at : at + 2].copy().view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [.., 16] bytes -> [.., 32]: low nibbles 0..15, high ones 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _planes(qs: np.ndarray, bits: int, width: int = 32) -> np.ndarray:
    """[.., g * width] bytes -> [.., g * (8 // bits) * width] values: ggml's K-quant order, each run of
    ``width`` bytes giving 8 // bits runs of ``width`` weights, its bits 0.. first."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(-1, 1)
    v = qs.reshape(*qs.shape[:-1], -1, 1, width) >> shifts
    return (v & ((1 << bits) - 1)).reshape(*qs.shape[:-1], -1)


def _subblocks(b: np.ndarray, x: np.ndarray) -> np.ndarray:  # [rows, n, 256 or 16 or 8 ..] -> [rows, n * 8, ..]
    return x.reshape(b.shape[0], b.shape[1] * (QK_K // QK), -1)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 scale bytes as the float32 ggml multiplies its doubled levels by: 2^(e - 128),
    exactly (``GGML_E8M0_TO_FP32_HALF``: e = 0 and 1 subnormal, bits 0x00200000 << e)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


def _legacy(fmt: BlockFormat, b: np.ndarray) -> Fields:
    if fmt.name == "mxfp4":  # one E8M0 byte, then nibbles indexing the levels
        return MXFP4_VALUES[_nibbles(b[..., 1:])], e8m0_half(b[..., 0:1]), None
    d = b[..., 0:2].copy().view(np.float16)
    m = _f16(b, 2) if fmt.has_min else None
    raw = b[..., 4 if fmt.has_min else 2 :]
    if fmt.name in ("q5_0", "q5_1"):  # the fifth bits of weights 0..31: bits 0..31 of a little-endian qh
        high = np.unpackbits(raw[..., :4], axis=-1, bitorder="little")
        return _nibbles(raw[..., 4:]) | (high << 4), d, m
    if fmt.name == "iq4_nl":
        return IQ4_VALUES[_nibbles(raw)], d, m
    return (_nibbles(raw) if fmt.nibbles else raw.view(np.int8)), d, m


def _k4_scales(b: np.ndarray) -> KScales:  # Q4_K's and Q5_K's: ggml's get_scale_min_k4
    lo, mid, hi = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return KScales(_f16(b, 0), _f16(b, 2), sc, m)


def _q3_k_scales(b: np.ndarray) -> KScales:  # 16 6-bit scales: low nibbles in bytes 0..7, top bits in 8..11
    s = b[..., 96:108]
    low = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    high = np.concatenate([(s[..., 8:12] >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=-1)
    return KScales(_f16(b, 108), None, (low | (high << 4)).view(np.int8) - np.int8(32), None)


def _iq4_xs_scales(b: np.ndarray) -> KScales:  # 8 6-bit scales: nibbles of bytes 4..7, top bits in the u16 at 2
    low = np.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], axis=-1).reshape(*b.shape[:2], 8)
    high = (b[..., 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03
    return KScales(_f16(b, 0), None, (low | (high.astype(np.uint8) << 4)).view(np.int8) - np.int8(32), None)


_SCALES: dict[str, Callable[[np.ndarray], KScales]] = {
    "q2_k": lambda b: KScales(_f16(b, 80), _f16(b, 82), b[..., 0:16] & 0x0F, b[..., 0:16] >> 4),
    "q3_k": _q3_k_scales,
    "q4_k": _k4_scales,
    "q5_k": _k4_scales,
    "q6_k": lambda b: KScales(_f16(b, 208), None, b[..., 192:208].view(np.int8), None),
    "iq4_xs": _iq4_xs_scales,
}


def unpack_scales(fmt: BlockFormat, b: np.ndarray) -> KScales:
    """A super-block type's scales as stored (:class:`KScales`); b uint8 [rows, n, block_bytes]."""
    if fmt.name not in _SCALES:
        raise ValueError(f"{fmt.name} has no super-block scales")
    return _SCALES[fmt.name](b)


def _products(ks: KScales) -> tuple[np.ndarray, np.ndarray | None]:
    """ggml's float32 scales of each sub-block: d * sc, and -(dmin * m) (the sign flipped exactly)."""
    d = ks.d.astype(np.float32)[..., None] * ks.sc.astype(np.float32)
    if ks.dmin is None:
        return d, None
    return d, -(ks.dmin.astype(np.float32)[..., None] * ks.m.astype(np.float32))


def _k_quant(fmt: BlockFormat, b: np.ndarray) -> Fields:
    d, m = _products(unpack_scales(fmt, b))
    if fmt.name in ("q4_k", "q5_k"):  # 32 bytes hold sub-block 2i in their low nibbles, 2i + 1 in their high ones
        q = _planes(b[..., -128:], 4)
        if fmt.name == "q5_k":  # bit s of qh's byte k: sub-block s's weight k
            q = q | (_planes(b[..., 16:48], 1) << 4)
    elif fmt.name == "q6_k":  # ql: 64 bytes, low nibbles then high ones, a 128; qh: 2 bits a 32
        q = (_planes(b[..., 0:128], 4, 64) | (_planes(b[..., 128:192], 2) << 4)).view(np.int8) - np.int8(32)
    elif fmt.name == "q3_k":  # 2 low bits, and 4 taken off where the hmask bit is 0: -4..3
        q = _planes(b[..., 32:96], 2).view(np.int8) + 4 * _planes(b[..., 0:32], 1).view(np.int8) - np.int8(4)
    elif fmt.name == "q2_k":
        q = _planes(b[..., 16:80], 2)
    else:  # iq4_xs: a sub-block's 16 bytes, low nibbles weights 0..15, high ones 16..31
        q = IQ4_VALUES[_nibbles(b[..., 8:].reshape(*b.shape[:2], 8, 16))]
    q, d = _subblocks(b, q), _subblocks(b, d)
    if m is not None:
        m = _subblocks(b, m)
        m = m[..., 0] if fmt.scales_per_block == 1 else m
    return q, d, m


def unpack_fields(fmt: BlockFormat, b: np.ndarray) -> Fields:
    """(q, d, m) per block of 32: q the integers the scales multiply [rows, nb, 32] (weight order;
    the table above), d [rows, nb, s] (s = ``scales_per_block``), m None, [rows, nb], or Q2_K's
    [rows, nb, 2]. b: uint8 [rows, n, block_bytes]."""
    if fmt.is_float:
        raise ValueError(f"{fmt.name} tensors are float weights, not blocks of integers: widen them")
    return _k_quant(fmt, b) if fmt.k_quant else _legacy(fmt, b)


def widen(fmt: BlockFormat, raw: np.ndarray) -> np.ndarray:
    """A float type's stored weights [rows, cols] as float32, exactly (gguf.quants.dequantize's values)."""
    raw = np.ascontiguousarray(raw)
    if fmt.name == "f32":
        return raw.view(np.float32)
    if fmt.name == "f16":
        return raw.view(np.float16).astype(np.float32)
    if fmt.name == "bf16":  # the top half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"{fmt.name} is not a float type")
