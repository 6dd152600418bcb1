"""The row-invariant kernels of ``cpu.c`` one call at a time: the small-M GEMM over
float32 or int8 weights, causal attention by query row, RMSNorm, RoPE into the KV
cache, the KV mirror of a token tree and the gated MLP; and the checks of their
arguments that :mod:`fastdecode.kernels.layer` shares. Why they are hand-written, and
how the library is loaded: :mod:`fastdecode.kernels.cpu`, which re-exports them.
"""

from __future__ import annotations

import torch

from fastdecode.kernels.abi import GLU_ACTIVATIONS, IMPLS, MAX_HEAD_DIM
from fastdecode.kernels.kv_formats import KERNEL_FORMATS, pool_format
from fastdecode.kernels.library import kernel as _kernel
from fastdecode.kernels.paged import PagedRows

__all__ = [
    "KERNEL_FORMATS",
    "attention_rows",
    "clamped_glu",
    "glu",
    "head_rms_norm_",
    "kv_mirror",
    "rms_norm",
    "rope_qkv",
    "rowgemm",
    "rowgemm_i8",
]


def _linear(x: torch.Tensor, n_out: int, k: int, bias: torch.Tensor | None, call) -> torch.Tensor:
    """The shared body of the GEMM wrappers: x [..., k] -> y [..., n_out], with
    ``call(x_ptr, m, y_ptr)`` filling the [m, n_out] result, then the bias."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError("fastdecode's GEMM takes float32 CPU activations")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    if k == 0:  # an empty reduction: zeros, as F.linear gives
        y = torch.zeros(*lead, n_out, dtype=torch.float32)
        return y if bias is None else y + bias
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    y = torch.empty(x2.shape[0], n_out, dtype=torch.float32)  # [M, N]
    if x2.shape[0]:
        call(x2.data_ptr(), x2.shape[0], y.data_ptr())
    if bias is not None:
        y += bias
    return y.view(*lead, n_out)


def rowgemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors, each row of the result
    bitwise independent of the other rows in ``x``.

    x: [..., in_features]; weight: [out_features, in_features] (contiguous);
    returns [..., out_features].
    """
    kernel = _kernel()
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise TypeError("rowgemm takes float32 CPU tensors")
    if not weight.is_contiguous():
        raise ValueError("rowgemm needs a contiguous weight")
    n_out, k = weight.shape
    return _linear(x, n_out, k, bias, lambda xp, m, yp: kernel.fd_rowgemm_f32(xp, m, k, weight.data_ptr(), n_out, yp))


def rowgemm_i8(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only int8 linear: ``(x @ qweight.T) * scales (+ bias)`` with float32
    activations, the sum reduced in exactly :func:`rowgemm`'s order, so each row of
    the result is bitwise independent of the other rows in ``x``.

    x: [..., in_features] float32; qweight: int8 [out_features, in_features]
    (contiguous); scales: float32 [out_features]."""
    kernel = _kernel()
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or not qweight.is_contiguous() or qweight.device.type != "cpu":
        raise TypeError("rowgemm_i8 takes a contiguous int8 CPU weight [out, in]")
    n_out, k = qweight.shape
    _check_f32(scales)
    if scales.shape != (n_out,):
        raise ValueError(f"rowgemm_i8: scales must be [{n_out}], got {tuple(scales.shape)}")
    return _linear(
        x,
        n_out,
        k,
        bias,
        lambda xp, m, yp: kernel.fd_rowgemm_i8(xp, m, k, qweight.data_ptr(), scales.data_ptr(), n_out, yp),
    )


def _as_pool(cache: torch.Tensor) -> torch.Tensor:
    return cache if cache.dim() == 4 else cache[None]  # [KV, cap, D] is one block of cap positions


def attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    scale: float,
    window: int | None = None,
    rows: PagedRows | None = None,
    impl: str = "auto",
    k_affine: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``n`` new query rows at positions ``start .. start + n - 1``,
    each (row, head) computed alone: a row's bits do not depend on ``n``. With a
    sliding ``window`` of W positions, the query at position p sees p - W + 1 .. p.

    q: [n, H, D], any row and head strides, each head's D values contiguous; k_cache, v_cache: [KV, capacity, W] contiguous,
    positions ``0 .. start + n - 1`` filled; H a multiple of KV (grouped-query). W is D for a
    float32 or float16 cache, a quantized row's bytes for q8_0 / q4_0 (``kernels.kv_formats``;
    K and V may differ). Or paged: caches [num_blocks, KV, block_size, W] and ``rows`` (``start``
    unused). ``impl`` (:data:`~fastdecode.kernels.abi.IMPLS`): ``avx512_vnni`` takes the zmm loops over
    a quantized cache where the CPU has them (``auto`` does), any other the ymm loops: the same bits.
    ``k_affine``: the keys' affine [KV, 3 + D, D] (mu, 1 / s, s, F; ``kv.c``'s ``kv_key_affine``) when they were
    written with one: each query head is taken as q * s of its KV head. ``softcap``: each score s taken
    as softcap * tanh(s / softcap) before the softmax (Gemma 2), None: as it is. ``sinks``: float32 [H], each
    head's attention sink (gpt-oss: one more logit in the softmax's denominator, with no value), None: none.
    Returns [n, H * D].
    """
    kernel = _kernel()
    if q.dim() != 3 or k_cache.dim() not in (3, 4):
        raise ValueError("attention_rows takes q [n, H, D] and caches [KV, capacity, D] or [blocks, KV, block_size, D]")
    n, n_heads, head_dim = q.shape
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise TypeError("attention_rows takes float32 CPU queries")
    kv_types = _kv_types(k_cache, v_cache, head_dim)
    k_pool, v_pool = _as_pool(k_cache), _as_pool(v_cache)
    n_kv = k_pool.shape[1]
    if rows is None:
        if start < 0:
            raise ValueError(f"attention_rows: start must be >= 0, got {start}")
        if start + n > k_pool.shape[2]:
            raise ValueError(f"positions up to {start + n} exceed the cache capacity {k_pool.shape[2]}")
        rows = PagedRows.contiguous(start, n, k_pool.shape[2])
    if rows.n != n:
        raise ValueError(f"attention_rows: {n} queries but {rows.n} rows")
    rows.check(k_pool)
    if window is not None and window < 1:
        raise ValueError(f"attention_rows: a sliding window must be >= 1 position, got {window}")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM or n_heads % n_kv:
        raise ValueError(f"attention_rows needs head_dim % 8 == 0, head_dim <= {MAX_HEAD_DIM} and H % KV == 0")
    if q.stride(2) != 1:
        raise ValueError("attention_rows needs contiguous heads in q")
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")
    affine = _affine_ptr(k_affine, n_kv, head_dim)
    out = torch.empty(n, n_heads * head_dim, dtype=torch.float32)
    scratch = torch.empty(rows.scores_floats(n_heads), dtype=torch.float32)  # the scores of every (row, head)
    kernel.fd_attention_f32(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        n,
        n_heads,
        n_kv,
        head_dim,
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        *rows.args(),
        scale,
        window or 0,
        scratch.data_ptr(),
        out.data_ptr(),
        *kv_types,
        IMPLS[impl],
        affine,
        softcap or 0.0,
        _sinks_ptr(sinks, n_heads),
    )
    return out


_KERNEL_DTYPES = (
    torch.float32,
    torch.float16,
    torch.uint8,
)  # a pool of these with rows of another width: a shape error


def _kv_types(k: torch.Tensor, v: torch.Tensor, head_dim: int) -> tuple[int, int]:
    """cpu.c's k_type and v_type for a K and V pool pair holding rows of ``head_dim`` values,
    after checking them: contiguous CPU tensors of one shape but the row, in formats the kernels
    read (:data:`KERNEL_FORMATS`)."""
    codes = []
    for pool in (k, v):
        fmt = pool_format(pool, head_dim)
        if fmt is None or fmt.code is None or pool.device.type != "cpu":
            error = ValueError if pool.dtype in _KERNEL_DTYPES and pool.device.type == "cpu" else TypeError
            raise error(
                f"fastdecode's CPU kernels take K and V caches of {', '.join(KERNEL_FORMATS)} rows on the CPU; "
                f"got {pool.dtype} rows of {pool.shape[-1]} for head_dim {head_dim} on {pool.device.type}"
            )
        if not pool.is_contiguous():
            raise ValueError("fastdecode's CPU kernels need contiguous K and V caches")
        codes.append(fmt.code)
    if k.shape[:-1] != v.shape[:-1] or k.dim() not in (3, 4):
        raise ValueError(
            f"K and V caches [KV, capacity, W] or [blocks, KV, block_size, W] of one shape but the row: "
            f"got {tuple(k.shape)} / {tuple(v.shape)}"
        )
    return codes[0], codes[1]


def _affine_ptr(k_affine: torch.Tensor | None, n_kv: int, head_dim: int) -> int | None:
    """The address of a key affine (None: none), after checking it is float32 [KV, 3 + head_dim, head_dim]
    on the CPU (``kv.c``'s ``KV_AFFINE_FLOATS``)."""
    if k_affine is None:
        return None
    _check_f32(k_affine)
    if k_affine.shape != (n_kv, 3 + head_dim, head_dim):
        raise ValueError(
            f"a key affine is [KV, 3 + head_dim, head_dim] = {(n_kv, 3 + head_dim, head_dim)}, got {tuple(k_affine.shape)}"
        )
    return k_affine.data_ptr()


def _sinks_ptr(sinks: torch.Tensor | None, n_heads: int) -> int | None:
    """The address of the heads' attention sinks (None: none), after checking they are float32 [H] on the CPU."""
    if sinks is None:
        return None
    _check_f32(sinks)
    if sinks.shape != (n_heads,):
        raise ValueError(f"attention_rows: sinks must be [{n_heads}] (one per query head), got {tuple(sinks.shape)}")
    return sinks.data_ptr()


def _check_f32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError("fastdecode's CPU kernels take contiguous float32 CPU tensors")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in float32, one call. x: [n, dim]; weight: [dim]."""
    kernel = _kernel()
    _check_f32(x, weight)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm takes x [n, dim] and weight [dim], got {tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty_like(x)
    kernel.fd_rmsnorm_f32(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())
    return out


def head_rms_norm_(
    qkv: torch.Tensor, first_head: int, heads: int, head_dim: int, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each head vector in place, for heads ``first_head .. first_head + heads - 1``
    of every row of a fused QKV output (Gemma 3's q_norm and k_norm, before RoPE).
    qkv: [n, width] with width >= (first_head + heads) * head_dim; weight: [head_dim]."""
    kernel = _kernel()
    _check_f32(qkv, weight)
    if (
        qkv.dim() != 2
        or qkv.shape[1] < (first_head + heads) * head_dim
        or first_head < 0
        or weight.shape != (head_dim,)
    ):
        raise ValueError(
            f"head_rms_norm_: {heads} heads of {head_dim} from head {first_head} do not fit qkv "
            f"{tuple(qkv.shape)} / weight {tuple(weight.shape)}"
        )
    kernel.fd_head_rmsnorm_f32(
        qkv.data_ptr() + first_head * head_dim * 4, qkv.shape[0], qkv.shape[1], heads, head_dim, weight.data_ptr(), eps
    )
    return qkv


def qk_rms_norm_(
    qkv: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    kind: str = "head",
) -> torch.Tensor:
    """The query and key norms of a fused QKV output [n, (H + 2 KV) D], in place, as ``fd_layer`` applies
    them: ``kind`` "head", RMSNorm of each head's vector (Gemma 3, Qwen3; weights [D]); "proj", of the
    whole query and key projections (OLMo 2; weights [H D] and [KV D])."""
    if kind == "head":
        head_rms_norm_(qkv, 0, n_heads, head_dim, q_norm, eps)
        return head_rms_norm_(qkv, n_heads, n_kv, head_dim, k_norm, eps)
    if kind != "proj":
        raise ValueError(f"qk_rms_norm_: unknown kind {kind!r}; choose head or proj")
    kernel = _kernel()
    _check_f32(qkv, q_norm, k_norm)
    q_width, k_width = n_heads * head_dim, n_kv * head_dim
    if (
        qkv.dim() != 2
        or qkv.shape[1] != q_width + 2 * k_width
        or q_norm.shape != (q_width,)
        or k_norm.shape != (k_width,)
    ):
        raise ValueError(
            f"qk_rms_norm_: qkv {tuple(qkv.shape)} or the norms do not fit {n_heads} + {n_kv} heads of {head_dim}"
        )
    n, width = qkv.shape
    kernel.fd_head_rmsnorm_f32(qkv.data_ptr(), n, width, 1, q_width, q_norm.data_ptr(), eps)
    kernel.fd_head_rmsnorm_f32(qkv.data_ptr() + q_width * 4, n, width, 1, k_width, k_norm.data_ptr(), eps)
    return qkv


def rope_qkv(
    qkv: torch.Tensor,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    rows: PagedRows | None = None,
    k_affine: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on the q and k parts of a fused QKV output; the rotated keys and the
    values are written into the caches at ``start ..`` (or, paged, at ``rows``'
    positions), each key as (k - mu) / s when ``k_affine`` [KV, 3 + D, D] is given
    (:func:`attention_rows` then takes it too); returns q, [n, H, D].

    qkv: [n, (H + 2 KV) * D]; cos, sin: [n, D]; k_cache, v_cache: [KV, capacity, D]
    or [num_blocks, KV, block_size, D] with ``rows`` (a row of W elements for a quantized
    cache, as :func:`attention_rows`'s)."""
    kernel = _kernel()
    _check_f32(qkv, cos, sin)
    kv_types = _kv_types(k_cache, v_cache, head_dim)
    if qkv.dim() != 2:
        raise ValueError(
            "rope_qkv takes qkv [n, (H + 2 KV) D] and caches [KV, capacity, D] or [blocks, KV, block_size, D]"
        )
    n = qkv.shape[0]
    if qkv.shape[1] != (n_heads + 2 * n_kv) * head_dim or cos.shape != (n, head_dim) or sin.shape != (n, head_dim):
        raise ValueError("rope_qkv: qkv, cos and sin do not match the head layout")
    k_pool, v_pool = _as_pool(k_cache), _as_pool(v_cache)
    if k_pool.shape[1] != n_kv:
        raise ValueError(
            f"rope_qkv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit {n_kv} KV heads of {head_dim}"
        )
    if rows is None:
        if start < 0:
            raise ValueError(f"rope_qkv: start must be >= 0, got {start}")
        if start + n > k_pool.shape[2]:
            raise ValueError(f"positions up to {start + n} exceed the cache capacity {k_pool.shape[2]}")
        rows = PagedRows.contiguous(start, n, k_pool.shape[2])
    if rows.n != n:
        raise ValueError(f"rope_qkv: {n} rows of qkv but {rows.n} positions")
    rows.check(k_pool)
    affine = _affine_ptr(k_affine, n_kv, head_dim)
    q = torch.empty(n, n_heads, head_dim, dtype=torch.float32)
    kernel.fd_rope_qkv_f32(
        qkv.data_ptr(),
        n,
        n_heads,
        n_kv,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k_pool.data_ptr(),
        v_pool.data_ptr(),
        *rows.args(),
        *kv_types,
        affine,
    )
    return q


def kv_mirror(k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows, head_dim: int) -> None:
    """Copy the keys and values ``rope_qkv`` wrote for ``rows`` to ``rows.mirrors``'
    places (token-tree verification; see :class:`PagedRows`). Pools [num_blocks, KV, block_size, W]
    of rows of ``head_dim`` values."""
    ptr, m = rows.mirror_args()
    if not m:
        return
    kernel = _kernel()
    kv_types = _kv_types(k_pool, v_pool, head_dim)
    if k_pool.dim() != 4:
        raise ValueError("kv_mirror: pools [num_blocks, KV, block_size, W] are needed")
    rows.check(k_pool)
    kernel.fd_kv_mirror(
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[1], head_dim, *rows.args(), ptr, m, *kv_types
    )


def glu(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The gated MLP of a fused gate/up output: [n, 2 * inter] -> act(gate) * up, [n, inter].
    ``silu`` (SwiGLU, Llama) or ``gelu_tanh`` (GeGLU with the tanh approximation, Gemma)."""
    kernel = _kernel()
    _check_f32(gate_up)
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"glu: unknown activation {activation!r}; choose one of {', '.join(GLU_ACTIVATIONS)}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"glu takes [n, 2 * inter], got {tuple(gate_up.shape)}")
    n, width = gate_up.shape
    out = torch.empty(n, width // 2, dtype=torch.float32)
    kernel.fd_glu_f32(gate_up.data_ptr(), n, width // 2, GLU_ACTIVATIONS.index(activation), out.data_ptr())
    return out


def clamped_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of a fused gate/up output [n, 2 * inter] (gate, then up): gate = min(gate,
    limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), [n, inter]; each element
    alone (row-invariant)."""
    kernel = _kernel()
    _check_f32(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"clamped_glu takes [n, 2 * inter], got {tuple(gate_up.shape)}")
    n, width = gate_up.shape
    out = torch.empty(n, width // 2, dtype=torch.float32)
    kernel.fd_glu_clamped_f32(gate_up.data_ptr(), n, width // 2, alpha, limit, out.data_ptr())
    return out
