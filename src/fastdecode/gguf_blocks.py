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

A Q5_0 tensor (``fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles``, weight =
``d * (q - 16)``) is read as the Q8_0 blocks of its exact weights (:func:`q5_0_as_q8_0`):
no kernel here reads five-bit quants, and Q8_0 holds every Q5_0 value with the same d.

Row order: ``convert_hf_to_gguf.py`` permutes the rows of Llama's q and k
projections for ggml's RoPE layout, and transformers' GGUF loader permutes them
back (``LlamaTensorProcessor``). Rows are whole blocks, so the same permutation
applied to the blocks is exact; :meth:`GGUFBlocks.matching` picks the row order
(as stored, or un-permuted) under which the file's blocks dequantize to exactly
the loaded model's weight, and refuses a tensor under which neither does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # weights per block
QK_K = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType
    block_bytes: int  # bytes of one stored block (a K-quant's super-block)
    has_min: bool  # Q4_1's m, Q4_K's -(dmin * m)
    nibbles: bool  # 4-bit quants, two to a byte (Q4_K's in an order of its own: :meth:`BlockTensor.fields`)
    block_weights: int = QK  # weights of one stored block: 32, or a K-quant's 256
    scales_per_block: int = 1  # scales per block of 32: Q6_K has one per 16 weights

    @property
    def k_quant(self) -> bool:
        return self.block_weights == QK_K


# The formats fastdecode quantizes float weights to (and saves), and the K-quants it reads from a file.
FORMATS: dict[str, BlockFormat] = {
    "q8_0": BlockFormat("q8_0", 8, 2 + QK, False, False),
    "q4_0": BlockFormat("q4_0", 2, 2 + QK // 2, False, True),
    "q4_1": BlockFormat("q4_1", 3, 4 + QK // 2, True, True),
}
K_FORMATS: dict[str, BlockFormat] = {
    "q4_k": BlockFormat("q4_k", 12, 4 + 12 + QK_K // 2, True, True, QK_K),
    "q6_k": BlockFormat("q6_k", 14, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, False, False, QK_K, 2),
}
_BY_GGML_TYPE = {f.ggml_type: f for f in (*FORMATS.values(), *K_FORMATS.values())}


def format_of_ggml_type(ggml_type: int) -> BlockFormat | None:
    return _BY_GGML_TYPE.get(int(ggml_type))


@dataclass(frozen=True)
class KScales:
    """A K-quant tensor's super-block scales as stored, [rows, n_super] each: ``d`` (and
    Q4_K's ``dmin``) fp16; Q4_K's 6-bit ``sc`` and ``m`` uint8 [rows, n_super, 8] (one a
    sub-block of 32); Q6_K's ``sc`` int8 [rows, n_super, 16] (one a 16 weights), ``m`` None."""

    d: np.ndarray
    dmin: np.ndarray | None
    sc: np.ndarray
    m: np.ndarray | None


@dataclass(frozen=True)
class BlockTensor:
    """A weight [rows, cols] in one block format. blocks: uint8 [rows, ceil(cols / w) * block_bytes],
    w the format's ``block_weights`` (32; a K-quant's 256, which must divide cols)."""

    format: BlockFormat
    blocks: np.ndarray
    cols: int
    file_type: str = ""  # the file's type when the blocks were converted exactly from another (Q5_0 as Q8_0)

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
        """A K-quant's super-block scales as stored (:class:`KScales`)."""
        b = self._stored()
        if self.format.name == "q4_k":  # ggml's get_scale_min_k4: 6-bit sc and m, top bits of 4..7 in bytes 0..7
            d, dmin = b[..., 0:2].copy().view(np.float16)[..., 0], b[..., 2:4].copy().view(np.float16)[..., 0]
            lo, mid, hi = b[..., 4:8], b[..., 8:12], b[..., 12:16]
            sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
            m = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
            return KScales(d, dmin, sc, m)
        if self.format.name == "q6_k":
            return KScales(b[..., 208:210].copy().view(np.float16)[..., 0], None, b[..., 192:208].view(np.int8), None)
        raise ValueError(f"{self.format.name} is not a K-quant")

    def fields(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(q, d, m) per block of 32: q the integers the scales multiply [rows, nb, 32] (int8 for
        Q8_0, uint8 0..15 for Q4_0 / Q4_1 / Q4_K, int8 q - 32 in -32..31 for Q6_K; weight order),
        d [rows, nb, s] (s = ``scales_per_block``: Q6_K's for weights 0..15 and 16..31), m [rows, nb]
        (None but for Q4_1 / Q4_K). Scales are the file's fp16 for Q8_0 / Q4_*, the float32
        products ggml forms for the K-quants (``d * sc``, ``-(dmin * m)``)."""
        fmt, rows = self.format, self.rows
        b = self._stored()
        if fmt.name == "q4_k":
            ks = self.k_scales()
            # 32 bytes hold sub-block 2i in their low nibbles and 2i + 1 in their high ones
            qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
            q = (qs & 0x0F).reshape(rows, -1, QK)
            d = ks.d.astype(np.float32)[..., None] * ks.sc.astype(np.float32)  # [rows, n_super, 8]
            m = -(ks.dmin.astype(np.float32)[..., None] * ks.m.astype(np.float32))
            return q, d.reshape(rows, -1, 1), m.reshape(rows, -1)
        if fmt.name == "q6_k":
            ks = self.k_scales()
            # a half of 128 weights: ql's 64 bytes' low nibbles are weights 0..63, high ones 64..127;
            # qh's 32 bytes hold weights 32 k .. 32 k + 31 in bits 2 k, 2 k + 1
            ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
            qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
            q = (ql & 0x0F).reshape(rows, -1, QK_K) | ((qh & 0x03).reshape(rows, -1, QK_K) << 4)
            q = (q.view(np.int8) - np.int8(32)).reshape(rows, -1, QK)
            d = ks.d.astype(np.float32)[..., None] * ks.sc.astype(np.float32)  # [rows, n_super, 16]
            return q, d.reshape(rows, -1, 2), None
        d = b[..., 0:2].copy().view(np.float16)
        m = b[..., 2:4].copy().view(np.float16)[..., 0] if fmt.has_min else None
        raw = b[..., 4 if fmt.has_min else 2 :]
        q = np.concatenate([raw & 0x0F, raw >> 4], axis=-1) if fmt.nibbles else raw.view(np.int8)
        return q, d, m

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the very values ``gguf.quants.dequantize`` gives."""
        q, d, m = self.fields()
        s = self.format.scales_per_block
        qf = torch.from_numpy(q.astype(np.float32)).view(self.rows, -1, s, QK // s)
        df = torch.from_numpy(d.astype(np.float32))[..., None]  # [rows, nb, s, 1]
        if self.format.name == "q4_0":
            w = df * (qf - 8)
        elif m is None:
            w = qf * df
        else:
            w = df * qf + torch.from_numpy(m.astype(np.float32))[..., None, None]
        return w.reshape(self.rows, -1)[:, : self.cols]

    def take_rows(self, index: np.ndarray) -> BlockTensor:
        return BlockTensor(self.format, np.ascontiguousarray(self.blocks[index]), self.cols, self.file_type)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str) -> BlockTensor:
        """``weight`` [rows, cols] in ``fmt`` with ggml's reference rounding (``ggml-quants.c``'s
        ``quantize_row_*_ref``, as gguf's ``quants.quantize`` does it, bit for bit), in torch ops;
        cols padded to a multiple of 32 with zeros. The K-quants are read from a file, not made here."""
        if fmt not in FORMATS:
            raise ValueError(
                f"fastdecode quantizes float weights to {', '.join(FORMATS)}, not {fmt!r}"
                + (" (K-quants are taken from a GGUF file as stored)" if fmt in K_FORMATS else "")
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


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def stack_rows(parts: Sequence[BlockTensor]) -> BlockTensor:
    """The parts' rows one after another (one format, one width)."""
    first = parts[0]
    if any(p.format != first.format or p.cols != first.cols for p in parts):
        raise ValueError("stack_rows: parts differ in format or width")
    return BlockTensor(
        first.format,
        np.concatenate([p.blocks for p in parts]),
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


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's ne: shape[0] is the row length
    ggml_type: int
    offset: int  # from the file's start


def read_tensor_infos(path: str) -> tuple[dict[str, object], dict[str, TensorInfo]]:
    """(scalar and string metadata, tensors by name) of a GGUF v2/v3 file, from its header alone.

    gguf's ``GGUFReader`` builds a numpy view of every metadata item, the tokenizer's
    100,000 strings included (~10 s here); this reads the header with struct and skips arrays."""
    import mmap
    import struct

    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

        def skip(vtype: int, count: int = 1) -> None:
            nonlocal pos
            if vtype == _GGUF_STRING:
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
            elif vtype == _GGUF_ARRAY:
                for _ in range(count):
                    etype, n = struct.unpack_from("<IQ", buf, pos)
                    pos += 12
                    skip(etype, n)
            else:
                pos += struct.calcsize("<" + _GGUF_SCALARS[vtype]) * count

        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype == _GGUF_STRING:
                meta[key] = string()
            elif vtype in _GGUF_SCALARS:
                (meta[key],) = struct.unpack_from("<" + _GGUF_SCALARS[vtype], buf, pos)
                skip(vtype)
            else:
                skip(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(shape), ggml_type, offset))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-pos // align) * align
    finally:
        buf.close()
    return meta, {n: TensorInfo(n, shape, t, data_start + off) for n, shape, t, off in infos}


Q5_0_TYPE, Q5_0_BLOCK_BYTES = 6, 2 + 4 + QK // 2  # gguf.GGMLQuantizationType.Q5_0: fp16 d, qh[4], qs[16]


def q5_0_as_q8_0(raw: np.ndarray, cols: int) -> BlockTensor:
    """Q5_0 blocks (``weight = d * (q - 16)``, q 5-bit: the low four bits in nibbles as Q4_0's,
    the fifth bits of weights j and 16 + j in bits j and 16 + j of qh) as the Q8_0 blocks of the
    very same weights: the same fp16 d, int8 q - 16 in -16..15. Exact, so a Q5_0 tensor runs on
    the Q8_0 kernels with the file's values (1.06 bytes a weight streamed instead of 0.69: no
    kernel reads five-bit quants). raw: uint8 [rows, nb * 22]."""
    rows, nb = raw.shape[0], -(-cols // QK)
    b = np.ascontiguousarray(raw).reshape(rows, nb, Q5_0_BLOCK_BYTES)
    qh = b[..., 2:6].copy().view("<u4")[..., 0][..., None]  # [rows, nb, 1]
    qs = b[..., 6:].astype(np.int16)
    j = np.arange(16, dtype=np.uint32)
    low = (qs & 0x0F) | (((qh >> j) << 4) & 0x10).astype(np.int16)
    high = (qs >> 4) | ((qh >> (j + 12)) & 0x10).astype(np.int16)
    q = (np.concatenate([low, high], axis=-1) - 16).astype(np.int8)
    blocks = np.concatenate([b[..., 0:2], q.view(np.uint8)], axis=-1).reshape(rows, -1)
    return BlockTensor(FORMATS["q8_0"], blocks, cols, file_type="q5_0")


class GGUFBlocks:
    """The tensors of one ``.gguf`` file, and which of them a model's modules can take."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        meta, self._tensors = read_tensor_infos(self.path)
        self.architecture = str(meta.get("general.architecture", ""))

    def type_name(self, name: str) -> str | None:
        from gguf import GGMLQuantizationType

        t = self._tensors.get(name)
        return None if t is None else GGMLQuantizationType(t.ggml_type).name.lower()

    def blocks(self, name: str) -> BlockTensor | None:
        """Tensor ``name`` as stored (file row order, memory-mapped), or None when absent or not
        Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K, or Q5_0 (converted exactly to Q8_0: :func:`q5_0_as_q8_0`)."""
        t = self._tensors.get(name)
        if t is None:
            return None
        cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:], dtype=np.int64))

        def stored(row_bytes: int) -> np.ndarray:
            return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(rows, row_bytes))

        if int(t.ggml_type) == Q5_0_TYPE:
            return q5_0_as_q8_0(stored(-(-cols // QK) * Q5_0_BLOCK_BYTES), cols)
        fmt = format_of_ggml_type(t.ggml_type)
        if fmt is None:
            return None
        return BlockTensor(fmt, stored(-(-cols // fmt.block_weights) * fmt.block_bytes), cols)

    # A wrong row order or tensor shows in the first (super-)block of every row; rows 0, middle and last are checked whole.
    def matching(
        self, module_name: str, weight: torch.Tensor, n_heads: int, n_kv_heads: int
    ) -> tuple[BlockTensor | None, str]:
        """The file's blocks for ``module_name`` in the row order under which they dequantize to
        ``weight`` (the loaded model's, [out, in]: every row's first block and three whole rows
        compared exactly); else (None, why not)."""
        names = [n for n in gguf_tensor_names(module_name) if n in self._tensors]
        if not names:
            return None, "not in the file"
        name = names[0]
        bt = self.blocks(name)
        if bt is None:
            return None, f"{name} is {self.type_name(name)}"
        if (bt.rows, bt.cols) != tuple(weight.shape):
            return None, f"{name} has shape {(bt.rows, bt.cols)}, the model's weight {tuple(weight.shape)}"
        orders = [np.arange(bt.rows)]
        for heads in dict.fromkeys((n_heads, n_kv_heads)):
            if heads and bt.rows % (2 * heads) == 0:
                orders.append(llama_unpermute(bt.rows, heads))
        target = weight.detach().cpu()
        width = min(bt.cols, bt.format.block_weights)
        first = BlockTensor(bt.format, np.ascontiguousarray(bt.blocks[:, : bt.format.block_bytes]), width)
        first_values = first.dequantize()
        probe_rows = sorted({0, bt.rows // 2, bt.rows - 1})
        for order in orders:
            if not torch.equal(first_values[torch.from_numpy(order)].to(target.dtype), target[:, :width]):
                continue
            whole = bt.take_rows(order[probe_rows]).dequantize()
            if torch.equal(whole.to(target.dtype), target[probe_rows]):
                return (bt if order is orders[0] else bt.take_rows(order)), ""
        return None, f"{name} does not dequantize to the model's weight"


def file_block_tensor(ggml_type: int, raw: np.ndarray, cols: int) -> BlockTensor | None:
    """A GGUF tensor's stored bytes (uint8 [rows, row bytes]) as the blocks the kernels run, exactly
    (Q5_0 as the Q8_0 of its weights: :func:`q5_0_as_q8_0`), or None for a type they do not run."""
    if int(ggml_type) == Q5_0_TYPE:
        return q5_0_as_q8_0(raw, cols)
    fmt = format_of_ggml_type(ggml_type)
    return None if fmt is None else BlockTensor(fmt, raw, cols)
