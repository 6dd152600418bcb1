"""Row-invariant CPU kernels (``cpu.c``): a small-M GEMM over float32 or int8
weights, causal attention by query row, and the fused glue of a decoder layer.
Load, call.

Why a hand-written kernel: a verification pass must give each of its K+1 rows
the very bits a one-token decode step gives that row (the output is then equal
to plain decoding by construction), and it must cost little more than one
step (otherwise speculation does not pay). torch's float32 ``F.linear`` runs
MKL, which gives a row the same bits only within row-count groups (the native
decoder then pads decode steps to two rows and cuts verification into chunks
of three, each costing about a decode step); oneDNN's prepacked linear is
invariant but slower at one row (docs/benchmarks.md). ``cpu.c`` reduces
every output in one fixed order whatever the row count, streaming the weights
once per call. Attention likewise: torch's SDPA gives a query row other bits
in an 8-query call than alone, so the native decoder called it once per row
and layer; ``attention_rows`` computes every (row, head) alone in one call.

How it is built and loaded: ``fastdecode.kernels.build`` (on first use, with the
machine's C compiler, into the fastdecode cache); :func:`rowgemm_unavailable` says
why it cannot be had here (not x86-64, no AVX2/FMA, no compiler) and callers fall
back to ``F.linear``. The ctypes signatures and structures: ``fastdecode.kernels.abi``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from fastdecode.kernels.abi import (
    GLU_ACTIVATIONS,
    IMPLS,
    MAX_HEAD_DIM,
    MAX_PARTS,
    WEIGHT_FORMATS,
    CLayerDesc,
    CPart,
    CProj,
    PackedBlocks,
    bind,
)
from fastdecode.kernels.build import SOURCE, SOURCES, build, cpu_reason, find_compiler
from fastdecode.kernels.paged import PagedRows

__all__ = ["GLU_ACTIVATIONS", "MAX_HEAD_DIM", "SOURCE", "SOURCES", "CLayerDesc", "DecoderLayerKernel", "LayerStack",
           "PagedRows", "Projection", "attention_rows", "glu", "head_rms_norm_", "kv_mirror", "rms_norm", "rope_qkv",
           "rowgemm", "rowgemm_i8", "rowgemm_unavailable", "run_layer_stack"]


def _compiler() -> str | None:
    return find_compiler()


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library with its functions typed, None) or (None, why it cannot be had)."""
    reason = cpu_reason()
    if reason is not None:
        return None, reason
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found to build the row-invariant kernel (set CC, or install gcc)"
    try:
        return bind(ctypes.CDLL(str(build(cc, SOURCE)))), None
    except (OSError, RuntimeError) as exc:
        return None, f"the row-invariant kernel could not be built: {exc}"


def rowgemm_unavailable() -> str | None:
    """None when :func:`rowgemm` can run on this machine, else why not."""
    return _load()[1]


def _kernel() -> ctypes.CDLL:
    kernel, reason = _load()
    if kernel is None:
        raise RuntimeError(reason)
    return kernel



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


def rowgemm_i8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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
    return _linear(x, n_out, k, bias,
                   lambda xp, m, yp: kernel.fd_rowgemm_i8(xp, m, k, qweight.data_ptr(), scales.data_ptr(), n_out, yp))



def _as_pool(cache: torch.Tensor) -> torch.Tensor:
    return cache if cache.dim() == 4 else cache[None]  # [KV, cap, D] is one block of cap positions


def attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, scale: float,
                   window: int | None = None, rows: PagedRows | None = None) -> torch.Tensor:
    """Causal attention of ``n`` new query rows at positions ``start .. start + n - 1``,
    each (row, head) computed alone: a row's bits do not depend on ``n``. With a
    sliding ``window`` of W positions, the query at position p sees p - W + 1 .. p.

    q: [n, H, D], any row and head strides, each head's D values contiguous; k_cache, v_cache: [KV, capacity, D] contiguous,
    positions ``0 .. start + n - 1`` filled; H a multiple of KV (grouped-query).
    Or paged: caches [num_blocks, KV, block_size, D] and ``rows`` (``start`` unused).
    Returns [n, H * D].
    """
    kernel = _kernel()
    if q.dim() != 3 or k_cache.dim() not in (3, 4):
        raise ValueError("attention_rows takes q [n, H, D] and caches [KV, capacity, D] or [blocks, KV, block_size, D]")
    n, n_heads, head_dim = q.shape
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise TypeError("attention_rows takes float32 CPU queries")
    kv_f16 = _kv_f16(k_cache, v_cache)
    if k_cache.shape[-1] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"attention_rows: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit head_dim {head_dim}")
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
    out = torch.empty(n, n_heads * head_dim, dtype=torch.float32)
    scratch = torch.empty(rows.scores_floats(n_heads), dtype=torch.float32)  # the scores of every (row, head)
    kernel.fd_attention_f32(q.data_ptr(), q.stride(0), q.stride(1), n, n_heads, n_kv, head_dim, k_pool.data_ptr(), v_pool.data_ptr(),
                     *rows.args(), scale, window or 0, scratch.data_ptr(), out.data_ptr(), kv_f16)
    return out


KV_DTYPES = (torch.float32, torch.float16)  # the KV pools cpu.c reads and writes (kv_f16)


def _kv_f16(k: torch.Tensor, v: torch.Tensor) -> int:
    """cpu.c's kv_f16 flag for a K and V pool pair, after checking them: contiguous CPU
    tensors of one dtype, float32 or float16."""
    if k.dtype not in KV_DTYPES or v.dtype != k.dtype or k.device.type != "cpu" or v.device.type != "cpu":
        raise TypeError("fastdecode's CPU kernels take K and V caches of one dtype, float32 or float16, on the CPU")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("fastdecode's CPU kernels need contiguous K and V caches")
    return int(k.dtype == torch.float16)


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


def head_rms_norm_(qkv: torch.Tensor, first_head: int, heads: int, head_dim: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head vector in place, for heads ``first_head .. first_head + heads - 1``
    of every row of a fused QKV output (Gemma 3's q_norm and k_norm, before RoPE).
    qkv: [n, width] with width >= (first_head + heads) * head_dim; weight: [head_dim]."""
    kernel = _kernel()
    _check_f32(qkv, weight)
    if qkv.dim() != 2 or qkv.shape[1] < (first_head + heads) * head_dim or first_head < 0 or weight.shape != (head_dim,):
        raise ValueError(f"head_rms_norm_: {heads} heads of {head_dim} from head {first_head} do not fit qkv "
                         f"{tuple(qkv.shape)} / weight {tuple(weight.shape)}")
    kernel.fd_head_rmsnorm_f32(qkv.data_ptr() + first_head * head_dim * 4, qkv.shape[0], qkv.shape[1], heads, head_dim,
                        weight.data_ptr(), eps)
    return qkv


def rope_qkv(qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, rows: PagedRows | None = None) -> torch.Tensor:
    """RoPE on the q and k parts of a fused QKV output; the rotated keys and the
    values are written into the caches at ``start ..`` (or, paged, at ``rows``'
    positions); returns q, [n, H, D].

    qkv: [n, (H + 2 KV) * D]; cos, sin: [n, D]; k_cache, v_cache: [KV, capacity, D]
    or [num_blocks, KV, block_size, D] with ``rows``."""
    kernel = _kernel()
    _check_f32(qkv, cos, sin)
    kv_f16 = _kv_f16(k_cache, v_cache)
    if qkv.dim() != 2 or k_cache.dim() not in (3, 4):
        raise ValueError("rope_qkv takes qkv [n, (H + 2 KV) D] and caches [KV, capacity, D] or [blocks, KV, block_size, D]")
    n = qkv.shape[0]
    if qkv.shape[1] != (n_heads + 2 * n_kv) * head_dim or cos.shape != (n, head_dim) or sin.shape != (n, head_dim):
        raise ValueError("rope_qkv: qkv, cos and sin do not match the head layout")
    k_pool, v_pool = _as_pool(k_cache), _as_pool(v_cache)
    if k_pool.shape[1] != n_kv or k_pool.shape[3] != head_dim or v_pool.shape != k_pool.shape:
        raise ValueError(f"rope_qkv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit {n_kv} KV heads of {head_dim}")
    if rows is None:
        if start < 0:
            raise ValueError(f"rope_qkv: start must be >= 0, got {start}")
        if start + n > k_pool.shape[2]:
            raise ValueError(f"positions up to {start + n} exceed the cache capacity {k_pool.shape[2]}")
        rows = PagedRows.contiguous(start, n, k_pool.shape[2])
    if rows.n != n:
        raise ValueError(f"rope_qkv: {n} rows of qkv but {rows.n} positions")
    rows.check(k_pool)
    q = torch.empty(n, n_heads, head_dim, dtype=torch.float32)
    kernel.fd_rope_qkv_f32(qkv.data_ptr(), n, n_heads, n_kv, head_dim, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                    k_pool.data_ptr(), v_pool.data_ptr(), *rows.args(), kv_f16)
    return q


def kv_mirror(k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows) -> None:
    """Copy the keys and values ``rope_qkv`` wrote for ``rows`` to ``rows.mirrors``'
    places (token-tree verification; see :class:`PagedRows`). Pools [num_blocks, KV, block_size, D]."""
    ptr, m = rows.mirror_args()
    if not m:
        return
    kernel = _kernel()
    kv_f16 = _kv_f16(k_pool, v_pool)
    if k_pool.dim() != 4 or v_pool.shape != k_pool.shape:
        raise ValueError("kv_mirror: pools [num_blocks, KV, block_size, D] of one shape are needed")
    rows.check(k_pool)
    kernel.fd_kv_mirror(k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[1], k_pool.shape[3], *rows.args(), ptr, m, kv_f16)



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


class Projection:
    """One linear layer as ``fd_project`` runs it: parts stacked by output (each float32
    [n, K], int8 [n, K] with per-output scales, or :class:`PackedBlocks`), then a bias.
    ``y = x W^T (+ bias)``; x: [M, in_features] float32, y: [M, out_features]."""

    def __init__(self, parts: Sequence, bias: torch.Tensor | None, in_features: int, impl: str = "auto") -> None:
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"a projection has 1 to {MAX_PARTS} parts, got {len(parts)}")
        if impl not in IMPLS:
            raise ValueError(f"unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")
        self.in_features = in_features
        self._keep: list[torch.Tensor] = []
        struct = CProj(n_parts=len(parts), impl=IMPLS[impl])
        n = 0
        for i, part in enumerate(parts):
            if isinstance(part, PackedBlocks):
                if part.cols != in_features:
                    raise ValueError(f"part {i} has {part.cols} inputs, the projection {in_features}")
                fmt, rows, w, scale = WEIGHT_FORMATS[part.format], part.rows, part.data, None
            else:
                w, scale = part
                if len(parts) > 1:
                    raise ValueError("float32 and int8 weights come as one part")
                if w.dim() != 2 or w.shape[1] != in_features or not w.is_contiguous() or w.device.type != "cpu":
                    raise ValueError(f"part {i}: a contiguous CPU weight [n, {in_features}] is needed")
                if scale is None:
                    if w.dtype != torch.float32:
                        raise TypeError("a float part must be float32")
                    fmt = WEIGHT_FORMATS["f32"]
                else:
                    if w.dtype != torch.int8 or scale.dtype != torch.float32 or scale.shape != (w.shape[0],) or not scale.is_contiguous():
                        raise TypeError("an int8 part takes contiguous float32 scales [n]")
                    fmt = WEIGHT_FORMATS["i8"]
                    self._keep.append(scale)
                rows = w.shape[0]
            self._keep.append(w)
            struct.part[i] = CPart(fmt, rows, w.data_ptr(), None if scale is None else scale.data_ptr())
            n += rows
        if bias is not None:
            if bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous():
                raise ValueError(f"the bias must be contiguous float32 [{n}]")
            self._keep.append(bias)
            struct.bias = bias.data_ptr()
        self.bias = bias
        self.out_features = n
        self.struct = struct
        self.blocks = any(isinstance(p, PackedBlocks) for p in parts)

    @property
    def ref(self):
        return ctypes.byref(self.struct)

    def scratch_bytes(self, rows: int) -> int:
        return _kernel().fd_project_scratch_bytes(self.ref, rows, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise TypeError(f"a projection takes float32 CPU activations [..., {self.in_features}]")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        if x2.shape[0] and self.in_features:
            _kernel().fd_project(x2.data_ptr(), x2.shape[0], self.in_features, self.ref, None, y.data_ptr())
        elif x2.shape[0]:
            y.zero_()
            if self.bias is not None:
                y += self.bias
        return y.view(*lead, self.out_features)



def _layer_projection(name: str, proj, in_features: int) -> Projection:
    """A :class:`DecoderLayerKernel` projection: a :class:`Projection` as it is, or one made of a
    ``(weight, scales, bias)`` tuple after checking it."""
    if isinstance(proj, Projection):
        return proj
    weight, scales, bias = proj
    if scales is None:
        _check_f32(weight)
    elif weight.dtype != torch.int8 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise TypeError(f"DecoderLayerKernel: {name} must be a contiguous int8 CPU weight")
    else:
        _check_f32(scales)
    if bias is not None:
        _check_f32(bias)
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"DecoderLayerKernel: {name} has shape {tuple(weight.shape)}, expected [*, {in_features}]")
    try:
        return Projection([(weight, scales)], bias, in_features)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"DecoderLayerKernel: {name}: {exc}") from None


def _check_gemma_norms(head_dim: int, hidden: int, q_norm, k_norm, post_attn_norm, post_mlp_norm) -> None:
    """Gemma 3's optional norms: q_norm and k_norm [head_dim] together, the post norms [hidden]."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("DecoderLayerKernel: q_norm and k_norm come together")
    for name, norm, dim in (("q_norm", q_norm, head_dim), ("k_norm", k_norm, head_dim),
                            ("post_attn_norm", post_attn_norm, hidden), ("post_mlp_norm", post_mlp_norm, hidden)):
        if norm is not None:
            _check_f32(norm)
            if norm.shape != (dim,):
                raise ValueError(f"DecoderLayerKernel: {name} has shape {tuple(norm.shape)}, expected ({dim},)")


class DecoderLayerKernel:
    """A whole decoder layer of a decode or verification pass in one call
    (``fd_layer``): the same kernels, in the same order, as calling
    :func:`rms_norm`, the projections, :func:`head_rms_norm_`,
    :func:`rope_qkv`, :func:`attention_rows` and :func:`glu` one by one - bit for
    bit - without returning to Python between them. The weights are checked once
    here and held by pointer.

    Each projection is a :class:`fastdecode.kernels.quant.Projection` (float32,
    int8 or ggml block weights; each its own) or a ``(weight, scales, bias)``
    tuple: weight nn.Linear's ``[out_features, in_features]``, float32 with
    ``scales`` None, or int8 with float32 per-output-channel ``scales``; bias
    float32 or None. ``qkv`` [(H + 2 KV) D, hidden], ``o`` [hidden, H D],
    ``gate_up`` [2 inter, hidden], ``down`` [hidden, inter].

    Gemma 3's additions (None for the Llama layout): ``q_norm`` and ``k_norm``
    [head_dim], ``post_attn_norm`` and ``post_mlp_norm`` [hidden] (every norm
    weight with its offset already added), ``activation`` (:data:`GLU_ACTIVATIONS`)
    and a sliding ``window``.
    """

    def __init__(self, attn_norm, qkv, o, mlp_norm, gate_up, down, n_heads: int, n_kv: int, head_dim: int,
                 eps: float, q_norm=None, k_norm=None, post_attn_norm=None, post_mlp_norm=None,
                 activation: str = "silu", window: int | None = None) -> None:
        self._kernel = _kernel()
        hidden = attn_norm.shape[0]
        _check_f32(attn_norm, mlp_norm)
        if attn_norm.shape != (hidden,) or mlp_norm.shape != (hidden,):
            raise ValueError("DecoderLayerKernel: the norms do not match the hidden size")

        gate_up = _layer_projection("gate_up", gate_up, hidden)
        inter = gate_up.out_features // 2
        projections = {"qkv": (_layer_projection("qkv", qkv, hidden), (n_heads + 2 * n_kv) * head_dim, hidden),
                       "o": (_layer_projection("o", o, n_heads * head_dim), hidden, n_heads * head_dim),
                       "gate_up": (gate_up, 2 * inter, hidden),
                       "down": (_layer_projection("down", down, inter), hidden, inter)}
        for name, (proj, n_out, n_in) in projections.items():
            if (proj.out_features, proj.in_features) != (n_out, n_in):
                raise ValueError(f"DecoderLayerKernel: {name} has shape {(proj.out_features, proj.in_features)}, "
                                 f"expected {(n_out, n_in)}")
        if head_dim % 8 or head_dim > MAX_HEAD_DIM or n_heads % n_kv:
            raise ValueError(f"DecoderLayerKernel needs head_dim % 8 == 0, head_dim <= {MAX_HEAD_DIM} and H % KV == 0")
        _check_gemma_norms(head_dim, hidden, q_norm, k_norm, post_attn_norm, post_mlp_norm)
        if activation not in GLU_ACTIVATIONS:
            raise ValueError(f"DecoderLayerKernel: unknown activation {activation!r}")
        if window is not None and window < 1:
            raise ValueError(f"DecoderLayerKernel: a sliding window must be >= 1 position, got {window}")
        self.projections = [p for p, _, _ in projections.values()]
        self._scratch: dict[int, int] = {}
        self._tensors = [attn_norm, mlp_norm, q_norm, k_norm, post_attn_norm, post_mlp_norm]  # held: pointers stay valid
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.hidden, self.inter, self.n_heads, self.n_kv, self.head_dim = hidden, inter, n_heads, n_kv, head_dim
        qkv_p, o_p, gate_up_p, down_p = (ctypes.addressof(p.struct) for p in self.projections)
        self._desc = CLayerDesc(ptr(attn_norm), ptr(mlp_norm), qkv_p, o_p, gate_up_p, down_p, ptr(q_norm), ptr(k_norm),
                                ptr(post_attn_norm), ptr(post_mlp_norm), n_heads, n_kv, head_dim, inter,
                                GLU_ACTIVATIONS.index(activation), window or 0, eps)
        self._desc_addr = ctypes.addressof(self._desc)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, start: int, scale: float, rows: PagedRows | None = None,
                 work: torch.Tensor | None = None) -> None:
        """Run the layer in place on x [n, hidden]; cos, sin: [n, head_dim] (the n
        positions' rows); k_cache, v_cache: [KV, capacity, D], written at start .. start + n - 1,
        or paged, [num_blocks, KV, block_size, D], written at ``rows``' positions.
        ``work``: optional scratch of at least :meth:`work_floats` floats (one buffer for every layer of a pass)."""
        k_pool, v_pool = _as_pool(k_cache), _as_pool(v_cache)
        if rows is None:
            if start < 0 or start + x.shape[0] > k_pool.shape[2]:
                raise ValueError("DecoderLayerKernel: the caches do not fit the positions")
            rows = PagedRows.contiguous(start, x.shape[0], k_pool.shape[2])
        run_layer_stack([self], x, [(cos, sin)], [k_pool], [v_pool], rows, scale, work)

    def _check(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, rows: PagedRows) -> None:
        _check_f32(x, cos, sin)
        _kv_f16(k_pool, v_pool)
        n, D = x.shape[0], self.head_dim
        if x.dim() != 2 or x.shape[1] != self.hidden or cos.shape != (n, D) or sin.shape != (n, D):
            raise ValueError("DecoderLayerKernel: x, cos or sin does not match the layer")
        if k_pool.dim() != 4 or k_pool.shape[1] != self.n_kv or k_pool.shape[3] != D or v_pool.shape != k_pool.shape:
            raise ValueError("DecoderLayerKernel: the caches do not fit the heads")
        if rows.n != n:
            raise ValueError(f"DecoderLayerKernel: {n} rows of x but {rows.n} positions")

    def work_floats(self, rows: PagedRows) -> int:
        return self._fixed_work_floats(rows.n) + rows.scores_floats(self.n_heads)

    def _fixed_work_floats(self, n: int) -> int:
        """The work of n rows but the attention scores: activations, then the block
        formats' quantized activations (asked of C once a row count)."""
        fixed = self._scratch.get(n)
        if fixed is None:
            H, KV, D, hidden, inter = self.n_heads, self.n_kv, self.head_dim, self.hidden, self.inter
            scratch = max(p.scratch_bytes(n) for p in self.projections)
            fixed = self._scratch[n] = n * (2 * hidden + (H + 2 * KV) * D + 2 * H * D + 3 * inter) + -(-scratch // 4)
        return fixed


class LayerStack:
    """Decoder layers run one after another, in place, by one C call a pass (``fd_layer_stack``).

    What does not change between passes is worked out once: the layers' descriptors
    (pointer array), the scratch each row count needs, and - for pools seen before (the
    same tensor objects, held here so their ids stay theirs) - the pools' checks and
    pointers. The rows' positions and block ids are checked every pass. Per-pass
    Python around the kernel costs ~0.6 ms of a ~7 ms decode step on the 2-core Zen 3
    when everything is redone each time (30 layers x 2 pools checked, 5 pointer arrays)."""

    def __init__(self, layers: Sequence[DecoderLayerKernel]) -> None:
        if not layers:
            raise ValueError("LayerStack: no layers")
        self.layers = list(layers)
        self.hidden = self.layers[0].hidden
        if any(layer.hidden != self.hidden for layer in self.layers):
            raise ValueError("LayerStack: the layers differ in hidden size")
        self._count = len(self.layers)
        self._descs = self._pointers(layer._desc_addr for layer in self.layers)
        self._n_heads = max(layer.n_heads for layer in self.layers)
        self._work: dict[int, int] = {}  # rows -> floats of work but the scores
        self._pools: tuple | None = None  # (k_pools, v_pools, k pointers, v pointers, kv_f16) last seen

    def _pointers(self, values) -> ctypes.Array:
        return (ctypes.c_void_p * self._count)(*values)

    def _pool_args(self, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor]) -> tuple:
        seen = self._pools
        if seen is not None and all(a is b for a, b in zip(seen[0], k_pools)) and all(a is b for a, b in zip(seen[1], v_pools)):
            return seen[2:]
        kv_f16 = _kv_f16(k_pools[0], v_pools[0])
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):  # each layer's own pools (attributes only)
            if _kv_f16(k_pool, v_pool) != kv_f16 or k_pool.shape != k_pools[0].shape or v_pool.shape != k_pool.shape:
                raise ValueError("run_layer_stack: every layer's K and V pools must be of one shape and dtype")
            if k_pool.dim() != 4 or k_pool.shape[1] != layer.n_kv or k_pool.shape[3] != layer.head_dim:
                raise ValueError("DecoderLayerKernel: the caches do not fit the heads")
        self._pools = (tuple(k_pools), tuple(v_pools), self._pointers(k.data_ptr() for k in k_pools),
                       self._pointers(v.data_ptr() for v in v_pools), kv_f16)
        return self._pools[2:]

    def work_floats(self, rows: PagedRows) -> int:
        fixed = self._work.get(rows.n)
        if fixed is None:
            # every layer asked: their widths and their projections' scratch (block formats or float) may differ
            fixed = self._work[rows.n] = max(layer._fixed_work_floats(rows.n) for layer in self.layers)
        # the scores of the layer with the most heads serve every layer (scores_floats reads the positions once)
        return fixed + rows.scores_floats(self._n_heads)

    def __call__(self, x: torch.Tensor, rope: Sequence[tuple[torch.Tensor, torch.Tensor]], k_pools: Sequence[torch.Tensor],
                 v_pools: Sequence[torch.Tensor], rows: PagedRows, scale: float, work: torch.Tensor | None = None) -> None:
        """Layer i with ``rope[i]`` (cos, sin [n, head_dim]) and the paged pools ``k_pools[i]``,
        ``v_pools[i]`` ([num_blocks, KV, block_size, D]), all at ``rows``' positions, in place on
        x [n, hidden]."""
        if not len(rope) == len(k_pools) == len(v_pools) == self._count:
            raise ValueError("run_layer_stack: one rope pair and one K and V pool per layer")
        k_ptrs, v_ptrs, kv_f16 = self._pool_args(k_pools, v_pools)
        checked = set()  # a rope table serves every layer of its type
        for layer, (cos, sin) in zip(self.layers, rope):
            key = (id(cos), id(sin), layer.head_dim)
            if key not in checked:
                layer._check(x, cos, sin, k_pools[0], v_pools[0], rows)
                checked.add(key)
        rows.check(k_pools[0])
        need = self.work_floats(rows)
        if work is None:
            work = torch.empty(need, dtype=torch.float32)
        elif work.dtype != torch.float32 or not work.is_contiguous() or work.numel() < need:
            raise ValueError(f"DecoderLayerKernel: work needs {need} contiguous float32 values")
        self.layers[0]._kernel.fd_layer_stack(
            x.data_ptr(), x.shape[0], self.hidden, self._descs, self._count,
            self._pointers(cos.data_ptr() for cos, _ in rope), self._pointers(sin.data_ptr() for _, sin in rope),
            k_ptrs, v_ptrs, *rows.args(), scale, work.data_ptr(), kv_f16, *rows.mirror_args())


def run_layer_stack(layers: Sequence[DecoderLayerKernel], x: torch.Tensor, rope: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], rows: PagedRows, scale: float,
                    work: torch.Tensor | None = None) -> None:
    """Run decoder layers one after another in place on x [n, hidden] (see :class:`LayerStack`,
    which a caller running the same layers every pass should keep instead)."""
    if len({len(layers), len(rope), len(k_pools), len(v_pools)}) != 1:
        raise ValueError("run_layer_stack: one rope pair and one K and V pool per layer")
    if layers:
        LayerStack(layers)(x, rope, k_pools, v_pools, rows, scale, work)
