"""GGUF's own block formats as fastdecode holds weights in them: read straight
from a ``.gguf`` file when it has them, or quantized from float weights with
ggml's rounding.

A block is 32 consecutive weights of one row (one output feature), laid out as
ggml lays it out (``ggml-common.h``)::

    Q8_0  fp16 d, 32 int8 q                          weight = d * q
    Q4_0  fp16 d, 16 bytes: 32 nibbles q in 0..15    weight = d * (q - 8)
    Q4_1  fp16 d, fp16 m, 16 bytes of nibbles        weight = d * q + m

In a nibble byte i, the low nibble is weight i and the high nibble weight 16 + i.
A tensor of ``rows x cols`` weights is ``rows`` rows of ``ceil(cols / 32)`` blocks
(a ``.gguf`` file's bytes, row after row); a float weight whose ``cols`` is not a
multiple of 32 is padded with zero weights.

The K-quants store super-blocks of 256 weights (read from a file only: fastdecode
does not quantize to them), and ``cols`` is a multiple of 256::

    Q4_K  fp16 d, fp16 dmin, 12 bytes of 6-bit sc[8] and m[8], 128 bytes of nibbles
          weight = (d * sc[j]) * q - (dmin * m[j])   in sub-block j of 32, q in 0..15
    Q6_K  128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 scales[16], fp16 d
          weight = (d * scales[k]) * (q - 32)        in 16-weight group k, q in 0..63

ggml (``dequantize_row_q4_K`` / ``_q6_K``, and gguf's ``quants``) forms each
product ``d * sc`` in float32 from the fp16 d, so every sub-block of 32 is an
ordinary block with float32 scales: Q4_K's is Q4_1's ``d * q + m`` with
``d = d * sc[j]`` and ``m = -(dmin * m[j])`` (x - y and x + (-y) are the same
float32 operation), Q6_K's is Q8_0's ``d * q`` with ``q - 32`` in -32..31 and one
scale for weights 0..15 and another for 16..31. :meth:`BlockTensor.fields` gives
them so, and the kernels (``fastdecode.kernels.quant``) run them as such.

Every other type a GGUF file holds (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS, MXFP4, and
the float types) is read the same way: :mod:`fastdecode.kernels.gguf_types` gives each one's layout, its
blocks' integers and scales, and how fastdecode runs it; :func:`file_blocks` makes a file's
tensor a :class:`BlockTensor`.

Row order: ``convert_hf_to_gguf.py`` permutes the rows of Llama's q and k
projections for ggml's RoPE layout, and transformers' GGUF loader permutes them
back (``LlamaTensorProcessor``). Rows are whole blocks, so the same permutation
applied to the blocks is exact; ``fastdecode.formats.gguf_match.GGUFBlocks.matching`` picks the row order
(as stored, or un-permuted) under which the file's blocks dequantize to exactly
the loaded model's weight, and refuses a tensor under which neither does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastdecode.kernels.gguf_types import (
    BLOCK_FORMATS,
    QK,
    QK_K,
    BlockFormat,
    KScales,
    gguf_type,
    row_bytes,
    unpack_fields,
    unpack_scales,
    widen,
)

__all__ = [
    "FORMATS",
    "K_FORMATS",
    "QK",
    "QK_K",
    "BlockFormat",
    "BlockRows",
    "BlockTensor",
    "KScales",
    "check_row_order",
    "file_blocks",
    "format_of_ggml_type",
    "gguf_tensor_names",
    "llama_unpermute",
    "row_bytes",
    "stack_rows",
]

# The formats fastdecode quantizes float weights to (and saves), and the K-quants Q4_K and Q6_K; every
# type a file may hold, and how fastdecode runs each: fastdecode.kernels.gguf_types (BLOCK_FORMATS, GGUF_TYPES).
FORMATS: dict[str, BlockFormat] = {n: BLOCK_FORMATS[n] for n in ("q8_0", "q4_0", "q4_1")}
K_FORMATS: dict[str, BlockFormat] = {n: BLOCK_FORMATS[n] for n in ("q4_k", "q6_k")}
_BY_GGML_TYPE = {f.ggml_type: f for f in BLOCK_FORMATS.values()}


def format_of_ggml_type(ggml_type: int) -> BlockFormat | None:
    return _BY_GGML_TYPE.get(int(ggml_type))


@dataclass(frozen=True)
class BlockTensor:
    """A weight [rows, cols] in one block format. blocks: uint8 [rows, ceil(cols / w) * block_bytes],
    w the format's ``block_weights`` (32; a K-quant's 256, which must divide cols)."""

    format: BlockFormat
    blocks: np.ndarray
    cols: int
    file_type: str = ""  # the file's type when the blocks were converted exactly from another

    def __post_init__(self) -> None:
        fmt = self.format
        if fmt.k_quant and self.cols % QK_K:
            raise ValueError(f"{fmt.name}: rows are whole super-blocks of {QK_K} weights, not {self.cols} columns")
        n = -(-self.cols // fmt.block_weights)
        if self.blocks.dtype != np.uint8 or self.blocks.ndim != 2 or self.blocks.shape[1] != n * fmt.block_bytes:
            raise ValueError(
                f"{fmt.name}: {self.cols} columns need uint8 rows of {n * fmt.block_bytes} "
                f"bytes, got {self.blocks.dtype} {self.blocks.shape}"
            )

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def n_blocks(self) -> int:
        """Blocks of 32 a row (a K-quant's super-block holds 8)."""
        return self.blocks.shape[1] // self.format.block_bytes * (self.format.block_weights // QK)

    def nbytes(self) -> int:
        return self.blocks.size

    def _stored(self) -> np.ndarray:  # uint8 [rows, stored blocks, block_bytes]
        return np.ascontiguousarray(self.blocks).reshape(self.rows, -1, self.format.block_bytes)

    def k_scales(self) -> KScales:
        """A super-block type's scales as stored (:class:`~fastdecode.kernels.gguf_types.KScales`)."""
        return unpack_scales(self.format, self._stored())

    def fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(q, d, m) per block of 32 (:func:`fastdecode.kernels.gguf_types.unpack_fields`): q the integers the
        scales multiply [rows, nb, 32] (weight order; Q4_0's and Q5_0's before their offset), d [rows, nb, s]
        (s = ``scales_per_block``), m None, [rows, nb] or Q2_K's [rows, nb, 2]. Scales are the file's fp16
        for the blocks of 32, the float32 products ggml forms for the super-block types (``d * sc``,
        ``-(dmin * m)``)."""
        return unpack_fields(self.format, self._stored())

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the very values ``gguf.quants.dequantize`` gives."""
        fmt = self.format
        if fmt.is_float:
            return torch.from_numpy(widen(fmt, self.blocks).reshape(self.rows, self.cols).copy())
        q, d, m = self.fields()
        s = fmt.scales_per_block
        qf = torch.from_numpy(q.astype(np.float32)).view(self.rows, -1, s, QK // s)
        if fmt.q_offset:
            qf = qf - fmt.q_offset  # exact
        df = torch.from_numpy(d.astype(np.float32))[..., None]  # [rows, nb, s, 1]
        if m is None:
            w = qf * df
        else:
            mf = torch.from_numpy(m.astype(np.float32))
            w = df * qf + (mf[..., None, None] if m.ndim == 2 else mf[..., None])
        return w.reshape(self.rows, -1)[:, : self.cols]

    def take_rows(self, index: np.ndarray) -> BlockTensor:
        """Rows ``index`` as a new tensor (a copy); :meth:`view_rows` moves nothing."""
        return BlockTensor(self.format, np.ascontiguousarray(self.blocks[index]), self.cols, self.file_type)

    def view_rows(self, index: np.ndarray) -> BlockRows:
        """Rows ``index`` as :meth:`take_rows` gives them, without moving them (:class:`BlockRows`)."""
        return BlockRows(self, index)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str) -> BlockTensor:
        """``weight`` [rows, cols] in ``fmt`` with ggml's reference rounding (``ggml-quants.c``'s
        ``quantize_row_*_ref``, as gguf's ``quants.quantize`` does it, bit for bit), in torch ops;
        cols padded to a multiple of 32 with zeros. The K-quants are read from a file, not made here."""
        if fmt not in FORMATS:
            raise ValueError(
                f"fastdecode quantizes float weights to {', '.join(FORMATS)}, not {fmt!r}"
                + (" (other types are taken from a GGUF file as stored)" if fmt in BLOCK_FORMATS else "")
            )
        fmt_ = FORMATS[fmt]
        w = weight.detach().to(device="cpu", dtype=torch.float32)
        rows, cols = w.shape
        nb = -(-cols // QK)
        x = torch.nn.functional.pad(w, (0, nb * QK - cols)).view(rows, nb, QK)
        m = None
        if fmt == "q8_0":
            d = x.abs().amax(-1) / 127
            a = (x * _inverse(d)[..., None]).abs()  # roundf: halves away from zero (gguf's np_roundf)
            whole = a.floor()
            q = (torch.sign(x) * (whole + (2 * (a - whole)).floor())).to(torch.int8).view(torch.uint8)
        elif fmt == "q4_0":
            extreme = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0]  # the signed value of largest magnitude
            d = extreme / -8
            q = torch.trunc(x * _inverse(d)[..., None] + 8.5).clamp_(0, 15).to(torch.uint8)
        else:
            lo, hi = x.amin(-1), x.amax(-1)  # (a block of zeros may keep another zero's sign than ggml's loop)
            d = (hi - lo) / 15
            q = torch.trunc((x - lo[..., None]) * _inverse(d)[..., None] + 0.5).clamp_(0, 15).to(torch.uint8)
            m = lo
        if fmt_.nibbles:
            q = q[..., :16] | (q[..., 16:] << 4)
        pieces = [d.to(torch.float16)[..., None].view(torch.uint8)]
        if m is not None:
            pieces.append(m.to(torch.float16)[..., None].view(torch.uint8))
        blocks = torch.cat(pieces + [q], dim=-1).reshape(rows, nb * fmt_.block_bytes)
        return cls(fmt_, blocks.numpy(), cols)


def check_row_order(order: np.ndarray, rows: int) -> np.ndarray:
    """``order`` as contiguous int64 [n] after checking that it picks rows of ``rows`` (a ValueError says how not)."""
    order = np.asarray(order)
    if order.ndim != 1 or order.dtype.kind not in "iu":
        raise ValueError(f"a row order is a 1-D integer array, got {order.dtype} {order.shape}")
    if order.size and (order.min() < 0 or order.max() >= rows):
        raise ValueError(f"a row order indexes {rows} rows, got {order.min()}..{order.max()}")
    return np.ascontiguousarray(order, dtype=np.int64)


@dataclass(frozen=True)
class BlockRows:
    """Rows ``order`` of ``tensor`` (what ``tensor.take_rows(order)`` holds) left where they are:
    ``fastdecode.kernels.quant_pack.pack`` reads them in place, so a model's load path (Llama's q
    and k rows un-permuted) makes no copy but the packed one. Everything else reads them through
    :meth:`materialize` (a copy)."""

    tensor: BlockTensor
    order: np.ndarray  # int64 [rows]: rows of tensor

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", check_row_order(self.order, self.tensor.rows))

    @property
    def format(self) -> BlockFormat:
        return self.tensor.format

    @property
    def cols(self) -> int:
        return self.tensor.cols

    @property
    def rows(self) -> int:
        return self.order.size

    @property
    def file_type(self) -> str:
        return self.tensor.file_type

    def nbytes(self) -> int:
        return self.rows * self.tensor.blocks.shape[1]

    def materialize(self) -> BlockTensor:
        return self.tensor.take_rows(self.order)

    def fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return self.materialize().fields()

    def dequantize(self) -> torch.Tensor:
        return self.materialize().dequantize()


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def stack_rows(parts: Sequence[BlockTensor | BlockRows]) -> BlockTensor:
    """The parts' rows one after another (one format, one width), copied; ``kernels.quant_pack.pack``
    packs several parts as one without this copy."""
    first = parts[0]
    if any(p.format != first.format or p.cols != first.cols for p in parts):
        raise ValueError("stack_rows: parts differ in format or width")
    return BlockTensor(
        first.format,
        np.concatenate([p.tensor.blocks[p.order] if isinstance(p, BlockRows) else p.blocks for p in parts]),
        first.cols,
        first.file_type if all(p.file_type == first.file_type for p in parts) else "",
    )


def llama_unpermute(rows: int, n_head: int) -> np.ndarray:
    """The row order transformers' GGUF loader gives a Llama q (n_head = heads) or k
    (n_head = KV heads) weight: HF row h * D + i * D / 2 + j is GGUF row h * D + 2 j + i."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


# The native decoder's modules and the llama.cpp tensor each one is stored as.
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")


def gguf_tensor_names(module_name: str) -> tuple[str, ...]:
    """The GGUF tensors that may hold transformers module ``module_name``'s weight, in the order to try
    (``lm_head``: ``output``, else the tied ``token_embd``)."""
    if module_name.split(".")[-1] == "lm_head":
        return ("output.weight", "token_embd.weight")
    m = _LAYER.fullmatch(module_name)
    if m and m.group(2) in _GGUF_NAMES:
        return (f"blk.{m.group(1)}.{_GGUF_NAMES[m.group(2)]}.weight",)
    return ()


def file_blocks(ggml_type: int, raw: np.ndarray, cols: int) -> BlockTensor:
    """A GGUF tensor's bytes as the :class:`BlockTensor` fastdecode runs: raw uint8 [rows, row_bytes]
    exactly as the file stores them (a memory map is kept, not copied), cols the row length (ggml's
    ne[0]). Its :meth:`~BlockTensor.dequantize` is ``gguf.quants.dequantize(raw, ggml_type)`` bit for
    bit. Block types run on the integer kernels as they are (``kernels.quant.pack`` repacks them once);
    F32 / F16 / BF16 are float weights (``dequantize`` widens them for the float GEMM). How each type
    runs and the bytes it costs: ``fastdecode.kernels.gguf_types.GGUF_TYPES``. A ValueError names a type
    fastdecode does not run, or bytes that do not fit the shape."""
    fmt = gguf_type(ggml_type).format
    if raw.ndim != 2 or raw.dtype != np.uint8 or raw.shape[1] != row_bytes(ggml_type, cols):
        raise ValueError(
            f"{fmt.name}: {cols} columns are uint8 rows of {row_bytes(ggml_type, cols)} bytes, "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )
    return BlockTensor(fmt, raw, cols)
