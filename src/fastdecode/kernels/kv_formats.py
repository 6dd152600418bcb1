"""What a KV cache pool holds: float32, float16, bfloat16 (torch's layer path only), or
ggml's q8_0 / q4_0 blocks of 32 values with an fp16 scale (``kv.c`` states the row layouts,
and why attention over them keeps the kernels' row invariance).

A pool is one layer's K or V: ``[num_blocks, KV, block_size, width]``, ``width`` the
row's elements - ``head_dim`` values of a float type, or ``head_dim / 32`` blocks of
34 (q8_0) or 18 (q4_0) bytes, uint8. :meth:`KVFormat.store` and :meth:`KVFormat.load`
are the torch side of ``kv.c``: the very bytes ``kv_store_row`` writes (ggml's reference
rounding, ``fastdecode.kernels.gguf_blocks``), and the values they stand for. They run torch's
layer path and the tests (that path scores q8_0 keys against the float32 query, where
cpu.c rounds the query to int8 blocks first: ``kv.c``'s ``kv_quantize_query``).

A quantized format may be ``rotated`` (kv.c's ``KV_ROTATED``): a row x is stored as the
blocks of H x, H the normalized Walsh-Hadamard transform of :func:`hadamard`, and attention
rotates its queries and its outputs to match, so the cache still means x. :meth:`KVFormat.load`
gives x's values (H applied back), :meth:`KVFormat.dequantize` the rotated values the kernel
reads.

A cache's keys may carry an *affine* (``kv.c``'s ``kv_key_affine``): per layer a float32 tensor
[KV, 3 + D, D] = (mu, 1 / s, s, F), each key row stored as the format's row of (k - mu) / s and the
queries taken as q * s, which leaves attention as it was in exact arithmetic, and a quantized row
rounded with the error feedback F (``kv.c``'s ``kv_store_blocks``: each element's rounding
error taken off the later ones, so that the error left is the one the queries see least)
(``fastdecode.kv.calibration`` says why and how it is found). :meth:`KVFormat.store` and
:meth:`KVFormat.load` take it (``affine`` [..., 3 + D, D], broadcast against the rows' heads).

A cache type names a format for the keys and one for the values (llama.cpp's ``-ctk`` /
``-ctv``): ``q8_0`` is both, ``q8_0/q4_0`` q8_0 keys and q4_0 values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fastdecode.kernels.abi import KV_FORMATS as KV_CODES
from fastdecode.kernels.abi import KV_ROTATED, MAX_HEAD_DIM
from fastdecode.kernels.gguf_blocks import FORMATS as BLOCK_FORMATS
from fastdecode.kernels.gguf_blocks import QK, BlockTensor
from fastdecode.kernels.library import kernel as library_kernel


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """H x over the last dimension D (float32): kv.c's ``kv_rotate``, the same float32 operations
    in the same order, so the same bits. H is block-diagonal, normalized Walsh-Hadamard blocks of
    G = the largest power of two dividing D; symmetric and orthonormal, hence its own inverse."""
    lead, d = x.shape[:-1], x.shape[-1]
    g = d & -d
    y = x.float().reshape(-1, d // g, g)
    h = 1
    while h < g:  # butterflies (a + b, a - b) at stride h, pairs j, j + h in blocks of 2h
        pairs = y.reshape(y.shape[0], d // g, g // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape)
        h *= 2
    scale = torch.tensor(1.0 / math.sqrt(g), dtype=torch.float32)  # as C's (float)(1.0 / sqrt((double)G))
    return (y * scale).reshape(*lead, d)


@dataclass(frozen=True)
class KVFormat:
    name: str
    dtype: torch.dtype  # the pool's elements
    quantized: bool = False  # rows of ggml blocks (the format of that name in gguf_blocks)
    rotated: bool = False  # rows stored Hadamard-rotated (quantized formats only)

    @property
    def code(self) -> int | None:
        """cpu.c's type code (kv.c's KV_*, with KV_ROTATED); None for a format only torch's layer path keeps."""
        code = KV_CODES.get(self.name)
        return None if code is None else code | (KV_ROTATED if self.rotated else 0)

    def row_width(self, head_dim: int) -> int:
        """The pool's last dimension for rows of ``head_dim`` values."""
        return head_dim // QK * BLOCK_FORMATS[self.name].block_bytes if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.dtype.itemsize

    def fits(self, head_dim: int) -> str | None:
        """None when rows of ``head_dim`` values can be held, else why not."""
        if self.quantized and head_dim % QK:
            return f"a {self.name} KV cache holds blocks of {QK} values: head_dim {head_dim} is not a multiple of {QK}"
        return None

    def store(
        self, x: torch.Tensor, affine: torch.Tensor | None = None, heads: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows ``x`` [..., head_dim] as the pool holds them, [..., width] (``kv_store_row``'s bytes);
        with a key ``affine`` [..., 3 + head_dim, head_dim] (broadcast against x's heads), the rows of
        (x - mu) * (1 / s), float32, rounded with its error feedback, as ``fd_rope_qkv_f32`` writes them;
        ``heads`` [rows] (with x [rows, head_dim] and ``affine`` [KV, 3 + head_dim, head_dim]): each row's
        KV head, for rows of several heads (a policy's moves per lane)."""
        if affine is not None:
            a = affine if heads is None else affine[heads, :2]
            x = (x.float() - a[..., 0, :]) * a[..., 1, :]
        if not self.quantized:
            return x.to(self.dtype)
        lead, d = x.shape[:-1], x.shape[-1]
        if self.rotated:
            x = hadamard(x)
        if affine is not None:
            shape = affine.shape[:-2]
            index = torch.arange(math.prod(shape)).view(shape).expand(lead).reshape(-1) if heads is None else heads
            rows = store_feedback(x.reshape(-1, d), affine.reshape(-1, 3 + d, d), index, self.name)
            return rows.to(x.device).view(*lead, self.row_width(d))
        blocks = BlockTensor.quantize(x.reshape(-1, d), self.name).blocks  # uint8 [rows, width]
        return torch.from_numpy(blocks).to(x.device).view(*lead, self.row_width(d))

    def load(self, rows: torch.Tensor, affine: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows [..., width] as the values they stand for: float32 [..., head_dim] for a
        quantized format (a rotated one rotated back), the stored dtype otherwise; with the key
        ``affine`` they were stored with, s * row + mu in float32."""
        values = rows
        if self.quantized:
            values = self.dequantize(rows)
            values = hadamard(values) if self.rotated else values
        return values if affine is None else values.float() * affine[..., 2, :] + affine[..., 0, :]

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """A quantized format's rows [..., width] as the float32 values cpu.c widens them to
        [..., head_dim] (a rotated format's rotated values)."""
        fmt = BLOCK_FORMATS[self.name]
        lead, width = rows.shape[:-1], rows.shape[-1]
        d = width // fmt.block_bytes * QK
        flat = np.ascontiguousarray(rows.detach().to("cpu").reshape(-1, width).numpy())
        return BlockTensor(fmt, flat, d).dequantize().to(rows.device).view(*lead, d)


FORMATS = {
    f.name: f
    for f in (
        KVFormat("float32", torch.float32),
        KVFormat("float16", torch.float16),
        KVFormat("bfloat16", torch.bfloat16),
        KVFormat("q8_0", torch.uint8, quantized=True),
        # rotated: SmolLM2-135M's perplexity over q4_0 K and V +9.95% of float32's, rotated +3.19% (benchmarks.md §11)
        KVFormat("q4_0", torch.uint8, quantized=True, rotated=True),
    )
}
KERNEL_FORMATS = tuple(name for name in FORMATS if name in KV_CODES)  # what cpu.c reads and writes
# The --kv-cache-dtype choices: a format for both, "auto" (the model's dtype), or keys/values.
MIXED = ("q8_0/q4_0", "float16/q8_0", "float16/q4_0")
KV_CACHE_DTYPES = ("auto", *FORMATS, *MIXED)


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> tuple[KVFormat, KVFormat]:
    """(keys' format, values' format) of a ``--kv-cache-dtype`` name; ValueError for another name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        name = str(model_dtype).removeprefix("torch.")
    k, _, v = name.partition("/")
    return FORMATS[k], FORMATS[v or k]


def kv_cache_dtype_name(k: KVFormat, v: KVFormat) -> str:
    return k.name if k == v else f"{k.name}/{v.name}"


def pool_format(pool: torch.Tensor, head_dim: int) -> KVFormat | None:
    """The format of a pool [..., width] holding rows of ``head_dim`` values; None if none fits."""
    for fmt in FORMATS.values():
        if fmt.dtype == pool.dtype and pool.shape[-1] == fmt.row_width(head_dim) and fmt.fits(head_dim) is None:
            return fmt
    return None


def store_feedback(x: torch.Tensor, affine: torch.Tensor, index: torch.Tensor, name: str, native: bool = True):
    """Rows x [n, D] (rotated where the format is) as q8_0 or q4_0 blocks, uint8 [n, width] on the CPU,
    rounded with error feedback: row r with the F of ``affine[index[r]]`` (``affine`` [m, 3 + D, D],
    ``kv.c``'s ``kv_store_blocks``). On the C library where it loads (``native``), else
    :func:`_store_feedback_torch`: the same bytes. Written here rather than taken from a library:
    ggml's and torch's quantizers round each block by itself."""
    n, d = x.shape
    if name not in ("q8_0", "q4_0") or d % QK or d > MAX_HEAD_DIM or affine.shape[1:] != (3 + d, d):
        raise ValueError(f"error feedback writes q8_0 or q4_0 rows of a multiple of {QK} values up to {MAX_HEAD_DIM}")
    x = x.detach().float().cpu().contiguous()
    affine = affine.detach().float().cpu().contiguous()
    index = index.cpu().to(torch.int64).contiguous()
    if index.shape != (n,) or (n and not 0 <= int(index.min()) <= int(index.max()) < affine.shape[0]):
        raise ValueError("error feedback: one head index a row, within the affine's heads")
    if native:
        try:
            kernel = library_kernel()
        except RuntimeError:  # no C library here (no compiler, not x86-64): torch's loop
            kernel = None
        if kernel is not None:
            out = torch.empty(n, d // QK * BLOCK_FORMATS[name].block_bytes, dtype=torch.uint8)
            kernel.fd_kv_store_feedback(
                x.data_ptr(), n, d, KV_CODES[name], affine.data_ptr(), index.data_ptr(), out.data_ptr()
            )
            return out
    return _store_feedback_torch(x, affine[:, 3:], index, name)


def _store_feedback_torch(x: torch.Tensor, f: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`store_feedback` in torch: x [n, D], f [m, D, D], row r with f[index[r]]; the same float32
    operations in the same order as ``kv.c``, with its guards for scales and errors that are not finite,
    so the same bytes."""
    d_all = x.shape[-1]
    w = x.clone()
    levels = torch.empty(w.shape, dtype=torch.int32)
    scales = []
    zero = torch.zeros(())
    for b in range(d_all // QK):
        blk = w[:, b * QK : (b + 1) * QK]
        mag = torch.nan_to_num(blk.abs(), nan=-1.0, posinf=math.inf)  # kv.c's scan passes over NaN
        at = mag.argmax(-1, keepdim=True)  # the first of the largest magnitude, as kv.c's scan
        mx = torch.where(mag.gather(-1, at) > 0, blk.gather(-1, at), zero)  # kv.c starts from +0
        d = mx.abs() / 127 if name == "q8_0" else mx / -8
        inv = torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), zero)
        inv = torch.where(torch.isfinite(inv), inv, zero)
        dh = d.half()
        scales.append(dh)
        dq = dh.float()
        for j in range(b * QK, (b + 1) * QK):
            r = w[:, j : j + 1] * inv
            if name == "q8_0":
                t = torch.trunc(r)  # roundf: halves away from zero (r - t is exact)
                level = torch.nan_to_num(t + torch.sign(r) * ((r - t).abs() >= 0.5), nan=0.0).clamp(-127, 127)
            else:
                level = torch.nan_to_num(torch.floor(r + 8.5), nan=0.0).clamp(0, 15) - 8
            levels[:, j : j + 1] = level.int()
            e = w[:, j : j + 1] - dq * level
            e = torch.where(torch.isfinite(e), e, zero)
            w[:, j + 1 :] -= e * f[index, j, j + 1 :]
    rows = []
    for b, dh in enumerate(scales):
        lv = levels[:, b * QK : (b + 1) * QK]
        if name == "q8_0":
            body = lv.to(torch.int8).view(torch.uint8)
        else:
            body = ((lv[:, : QK // 2] + 8) | ((lv[:, QK // 2 :] + 8) << 4)).to(torch.uint8)
        rows += [dh.view(torch.uint8), body]
    return torch.cat(rows, -1)
