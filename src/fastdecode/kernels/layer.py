"""A decoder layer of a decode or verification pass in one C call (``fd_layer``), and
the layers of a pass in one (``fd_layer_stack``): :class:`Projection` (a linear layer
over float32, int8 or ggml block weights, as ``fd_project`` runs it),
:class:`DecoderLayerKernel`, :class:`LayerStack`. Bit for bit the kernels of
:mod:`fastdecode.kernels.ops` called one by one; :mod:`fastdecode.kernels.cpu`
re-exports them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from fastdecode.kernels.abi import (
    ALONE_FORMATS,
    FFN_KINDS,
    GLU_ACTIVATIONS,
    IMPLS,
    MAX_HEAD_DIM,
    MAX_PARTS,
    QK_NORMS,
    WEIGHT_FORMATS,
    CGatedMLP,
    CLayerDesc,
    CPart,
    CProj,
    PackedBlocks,
)
from fastdecode.kernels.library import kernel as _kernel
from fastdecode.kernels.ops import _affine_ptr, _as_pool, _check_f32, _kv_types
from fastdecode.kernels.paged import PagedRows

__all__ = ["DecoderLayerKernel", "LayerStack", "Projection", "run_layer_stack"]


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
                if part.format in ALONE_FORMATS and len(parts) > 1:
                    raise ValueError(f"{part.format} weights come as one part")
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
                    if (
                        w.dtype != torch.int8
                        or scale.dtype != torch.float32
                        or scale.shape != (w.shape[0],)
                        or not scale.is_contiguous()
                    ):
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

    def prepared(self, x: torch.Tensor):
        """A zero-argument call running the kernel on ``x`` [M, in_features] (float32) into an output
        and scratch allocated once, returning the output: what a decoder pass's C code calls, without
        Python's checks and allocations around it (``fastdecode probe`` times the kernels so)."""
        x2 = self._check_input(x).reshape(-1, self.in_features).contiguous()
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        scratch = torch.empty(max(1, self.scratch_bytes(x2.shape[0])), dtype=torch.uint8)
        fn, args = _kernel().fd_project, (x2.data_ptr(), x2.shape[0], self.in_features, self.ref, scratch.data_ptr())

        def run() -> torch.Tensor:
            fn(*args, y.data_ptr())
            return y

        run.buffers = (x2, y, scratch)  # held while the call lives
        return run

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise TypeError(f"a projection takes float32 CPU activations [..., {self.in_features}]")
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = self._check_input(x).shape[:-1]
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


def _check_norms(hidden: int, norms: dict, q_norm, k_norm, q_width: int, k_width: int) -> None:
    """The branch norms [hidden] (each optional); q_norm [q_width] and k_norm [k_width] together or neither."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("DecoderLayerKernel: q_norm and k_norm come together")
    for name, norm, dim in (
        *((name, norm, hidden) for name, norm in norms.items()),
        ("q_norm", q_norm, q_width),
        ("k_norm", k_norm, k_width),
    ):
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
    here and held by pointer (``backends/layer.py`` builds one from a layer's description).

    Each projection is a :class:`fastdecode.kernels.quant.Projection` (float32,
    int8 or ggml block weights; each its own) or a ``(weight, scales, bias)``
    tuple: weight nn.Linear's ``[out_features, in_features]``, float32 with
    ``scales`` None, or int8 with float32 per-output-channel ``scales``; bias
    float32 or None. ``qkv`` [(H + 2 KV) D, hidden], ``o`` [hidden, H D],
    ``gate_up`` [2 inter, hidden], ``down`` [hidden, inter]: the FFN of kind ``gated``
    (:data:`~fastdecode.kernels.abi.FFN_KINDS`); both None: kind ``none``, the layer's attention half,
    a call returning the FFN's input (``mlp_norm``'s output, or the residual stream) for the caller to
    run the FFN and add its branch (a mixture of experts with a shared expert: ``backends/layer.py``).
    ``moe`` (:class:`~fastdecode.kernels.experts.MoEKernel`) in their place: the FFN of kind ``experts``,
    router, top-k and experts in the same call.

    Every norm weight comes with its offset already added (Gemma's 1 + w). ``attn_norm`` and
    ``mlp_norm`` [hidden] precede their branch, ``post_attn_norm`` and ``post_mlp_norm`` [hidden]
    follow it (None: absent; OLMo 2 has only the post norms, Gemma all four); ``q_norm`` and
    ``k_norm``: per head ([head_dim], ``qk_norm="head"``) or over the whole projection ([H D] and
    [KV D], ``qk_norm="proj"``); ``activation`` (:data:`GLU_ACTIVATIONS`); a sliding ``window``;
    ``residual_scale`` multiplies each branch before its residual add (Granite); ``softcap`` caps the
    attention scores, s -> softcap * tanh(s / softcap) (Gemma 2); ``sinks`` float32 [n_heads]: each head's
    attention sink, one more logit in the softmax's denominator (gpt-oss; :func:`attention_rows`'s).
    """

    def __init__(
        self,
        attn_norm,
        qkv,
        o,
        mlp_norm,
        gate_up,
        down,
        n_heads: int,
        n_kv: int,
        head_dim: int,
        eps: float,
        q_norm=None,
        k_norm=None,
        post_attn_norm=None,
        post_mlp_norm=None,
        activation: str = "silu",
        window: int | None = None,
        *,
        qk_norm: str = "head",
        residual_scale: float = 1.0,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        moe=None,
    ) -> None:
        self._kernel = _kernel()
        if head_dim % 8 or head_dim > MAX_HEAD_DIM or n_heads % n_kv:
            raise ValueError(f"DecoderLayerKernel needs head_dim % 8 == 0, head_dim <= {MAX_HEAD_DIM} and H % KV == 0")
        o = _layer_projection("o", o, n_heads * head_dim)
        hidden = o.out_features
        norms = {"attn_norm": attn_norm, "post_attn_norm": post_attn_norm, "mlp_norm": mlp_norm}
        norms["post_mlp_norm"] = post_mlp_norm
        if qk_norm not in QK_NORMS:
            raise ValueError(f"DecoderLayerKernel: unknown qk_norm {qk_norm!r}; choose one of {', '.join(QK_NORMS)}")
        widths = (head_dim, head_dim) if qk_norm == "head" else (n_heads * head_dim, n_kv * head_dim)
        _check_norms(hidden, norms, q_norm, k_norm, *widths)
        projections = {
            "qkv": (_layer_projection("qkv", qkv, hidden), (n_heads + 2 * n_kv) * head_dim, hidden),
            "o": (o, hidden, n_heads * head_dim),
        }
        if (gate_up is None) != (down is None):
            raise ValueError("DecoderLayerKernel: gate_up and down come together (neither: no FFN)")
        self.ffn_kind, inter, self.moe = "none", 0, moe
        if moe is not None:
            if gate_up is not None:
                raise ValueError(
                    "DecoderLayerKernel: a layer's FFN is gated (gate_up, down) or experts (moe), not both"
                )
            if moe.experts.hidden != hidden:
                raise ValueError(f"DecoderLayerKernel: experts of hidden {moe.experts.hidden} in a layer of {hidden}")
            self.ffn_kind = "experts"
        if gate_up is not None:
            self.ffn_kind = "gated"
            gate_up = _layer_projection("gate_up", gate_up, hidden)
            inter = gate_up.out_features // 2
            projections["gate_up"] = (gate_up, 2 * inter, hidden)
            projections["down"] = (_layer_projection("down", down, inter), hidden, inter)
        for name, (proj, n_out, n_in) in projections.items():
            if (proj.out_features, proj.in_features) != (n_out, n_in):
                raise ValueError(
                    f"DecoderLayerKernel: {name} has shape {(proj.out_features, proj.in_features)}, "
                    f"expected {(n_out, n_in)}"
                )
        if activation not in GLU_ACTIVATIONS:
            raise ValueError(f"DecoderLayerKernel: unknown activation {activation!r}")
        if window is not None and window < 1:
            raise ValueError(f"DecoderLayerKernel: a sliding window must be >= 1 position, got {window}")
        self.projections = [p for p, _, _ in projections.values()]
        self._scratch: dict[int, int] = {}
        if sinks is not None:
            _check_f32(sinks)
            if sinks.shape != (n_heads,):
                raise ValueError(f"DecoderLayerKernel: sinks has shape {tuple(sinks.shape)}, expected ({n_heads},)")
        self._tensors = [*norms.values(), q_norm, k_norm, sinks]  # held: pointers stay valid
        self.hidden, self.inter, self.n_heads, self.n_kv, self.head_dim = hidden, inter, n_heads, n_kv, head_dim
        if softcap is not None and not softcap > 0:
            raise ValueError(f"DecoderLayerKernel: a soft cap must be > 0, got {softcap}")
        scalars = dict(eps=eps, residual_scale=residual_scale, softcap=softcap or 0.0)
        self._desc = self._describe(norms, (q_norm, k_norm, sinks), qk_norm, activation, window, scalars)
        self._desc_addr = ctypes.addressof(self._desc)

    def _describe(self, norms: dict, heads: tuple, qk_norm: str, activation, window, scalars: dict):
        """The layer's CLayerDesc (and the CGatedMLP it points at, held here); heads: (q_norm, k_norm, sinks)."""
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        qkv, o, *ffn = (ctypes.addressof(p.struct) for p in self.projections)
        self._ffn = CGatedMLP(*ffn, self.inter, GLU_ACTIVATIONS.index(activation)) if ffn else None
        if self.moe is not None:
            self._ffn = self.moe.desc  # held by the MoEKernel, which holds what it points at
        return CLayerDesc(
            *(ptr(t) for t in norms.values()),
            qkv,
            o,
            *(ptr(t) for t in heads),
            None if self._ffn is None else ctypes.addressof(self._ffn),
            self.n_heads,
            self.n_kv,
            self.head_dim,
            QK_NORMS.index(qk_norm),
            window or 0,
            FFN_KINDS.index(self.ffn_kind),
            **scalars,
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
        scale: float,
        rows: PagedRows | None = None,
        work: torch.Tensor | None = None,
        k_affine: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run the layer in place on x [n, hidden]; cos, sin: [n, head_dim] (the n
        positions' rows); k_cache, v_cache: [KV, capacity, D], written at start .. start + n - 1,
        or paged, [num_blocks, KV, block_size, D], written at ``rows``' positions; ``k_affine``: the
        keys' affine [KV, 3 + D, D] (:func:`~fastdecode.kernels.ops.rope_qkv`) or None.
        ``work``: optional scratch of at least :meth:`work_floats` floats (one buffer for every layer of a pass).
        Returns None, or without an FFN the FFN's input [n, hidden] (a view of the work)."""
        k_pool, v_pool = _as_pool(k_cache), _as_pool(v_cache)
        if rows is None:
            if start < 0 or start + x.shape[0] > k_pool.shape[2]:
                raise ValueError("DecoderLayerKernel: the caches do not fit the positions")
            rows = PagedRows.contiguous(start, x.shape[0], k_pool.shape[2])
        return LayerStack([self])(x, [(cos, sin)], [k_pool], [v_pool], rows, scale, work, [k_affine])

    def _check(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        rows: PagedRows,
    ) -> None:
        _check_f32(x, cos, sin)
        n, D = x.shape[0], self.head_dim
        if x.dim() != 2 or x.shape[1] != self.hidden or cos.shape != (n, D) or sin.shape != (n, D):
            raise ValueError("DecoderLayerKernel: x, cos or sin does not match the layer")
        self._check_pools(k_pool, v_pool)
        if rows.n != n:
            raise ValueError(f"DecoderLayerKernel: {n} rows of x but {rows.n} positions")

    def _check_pools(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int]:
        """The pools' (k_type, v_type), after checking they hold this layer's KV heads."""
        try:
            kv_types = _kv_types(k_pool, v_pool, self.head_dim)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"DecoderLayerKernel: the caches do not fit the heads ({exc})") from None
        if k_pool.dim() != 4 or k_pool.shape[1] != self.n_kv:
            raise ValueError("DecoderLayerKernel: the caches do not fit the heads")
        return kv_types

    def work_floats(self, rows: PagedRows) -> int:
        return self._fixed_work_floats(rows.n) + rows.scores_floats(self.n_heads)

    def _fixed_work_floats(self, n: int) -> int:
        """The work of n rows but the attention scores: activations, then the block
        formats' quantized activations (asked of C once a row count)."""
        fixed = self._scratch.get(n)
        if fixed is None:
            H, KV, D, hidden = self.n_heads, self.n_kv, self.head_dim, self.hidden
            scratch = max(p.scratch_bytes(n) for p in self.projections)
            ffn = self._kernel.fd_layer_ffn_floats(self._desc_addr, n)  # the FFN kind's own work
            fixed = self._scratch[n] = n * (2 * hidden + (H + 2 * KV) * D + 2 * H * D) + ffn + -(-scratch // 4)
        return fixed


class LayerStack:
    """Decoder layers run one after another, in place, by one C call a pass (``fd_layer_stack``).

    What does not change between passes is worked out once: the layers' descriptors
    (pointer array), the scratch each row count needs, and - for pools seen before (the
    same tensor objects, held here so their ids stay theirs) - the pools' checks and
    pointers. The rows' positions and block ids are checked every pass. Per-pass
    Python around the kernel costs ~0.6 ms of a ~7 ms decode step on the 2-core Zen 3
    when everything is redone each time (30 layers x 2 pools checked, 5 pointer arrays).

    The last layer may have no FFN (kind ``none``, a mixture of experts' attention half): a call then
    returns that layer's FFN input [n, hidden], a view of the work, for the caller's FFN."""

    def __init__(self, layers: Sequence[DecoderLayerKernel]) -> None:
        if not layers:
            raise ValueError("LayerStack: no layers")
        self.layers = list(layers)
        self.hidden = self.layers[0].hidden
        if any(layer.hidden != self.hidden for layer in self.layers):
            raise ValueError("LayerStack: the layers differ in hidden size")
        if any(layer.ffn_kind == "none" for layer in self.layers[:-1]):
            raise ValueError("LayerStack: only the last layer may leave its FFN to the caller")
        self._count = len(self.layers)
        self._descs = self._pointers(layer._desc_addr for layer in self.layers)
        self._n_heads = max(layer.n_heads for layer in self.layers)
        self._work: dict[int, int] = {}  # rows -> floats of work but the scores
        # (k_pools, v_pools, k_affines, k pointers, v pointers, kv types, affine pointers) last seen
        self._pools: tuple | None = None

    def _pointers(self, values) -> ctypes.Array:
        return (ctypes.c_void_p * self._count)(*values)

    def _pool_args(self, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], k_affines) -> tuple:
        seen = self._pools
        k_affines = [None] * self._count if k_affines is None else list(k_affines)
        if (
            seen is not None
            and all(a is b for a, b in zip(seen[0], k_pools))
            and all(a is b for a, b in zip(seen[1], v_pools))
            and all(a is b for a, b in zip(seen[2], k_affines))
        ):
            return seen[3:]
        if len(k_affines) != self._count:
            raise ValueError("run_layer_stack: one key affine (or None) per layer")
        affines = [_affine_ptr(a, layer.n_kv, layer.head_dim) for layer, a in zip(self.layers, k_affines)]
        kv_types = self.layers[0]._check_pools(k_pools[0], v_pools[0])
        for layer, k_pool, v_pool in zip(self.layers, k_pools, v_pools):  # each layer's own pools (attributes only)
            if (
                layer._check_pools(k_pool, v_pool) != kv_types
                or k_pool.shape != k_pools[0].shape
                or v_pool.shape != v_pools[0].shape
            ):
                raise ValueError("run_layer_stack: every layer's K and V pools must be of one shape and dtype")
        self._pools = (
            tuple(k_pools),
            tuple(v_pools),
            tuple(k_affines),
            self._pointers(k.data_ptr() for k in k_pools),
            self._pointers(v.data_ptr() for v in v_pools),
            kv_types,
            self._pointers(affines) if any(a is not None for a in affines) else None,
        )
        return self._pools[3:]

    def work_floats(self, rows: PagedRows) -> int:
        fixed = self._work.get(rows.n)
        if fixed is None:
            # every layer asked: their widths and their projections' scratch (block formats or float) may differ
            fixed = self._work[rows.n] = max(layer._fixed_work_floats(rows.n) for layer in self.layers)
        # the scores of the layer with the most heads serve every layer (scores_floats reads the positions once)
        return fixed + rows.scores_floats(self._n_heads)

    def __call__(
        self,
        x: torch.Tensor,
        rope: Sequence[tuple[torch.Tensor, torch.Tensor]],
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        rows: PagedRows,
        scale: float,
        work: torch.Tensor | None = None,
        k_affines: Sequence[torch.Tensor | None] | None = None,
    ) -> torch.Tensor | None:
        """Layer i with ``rope[i]`` (cos, sin [n, head_dim]), the paged pools ``k_pools[i]``,
        ``v_pools[i]`` ([num_blocks, KV, block_size, D]) and their keys' affine ``k_affines[i]``
        ([KV, 3 + D, D] or None; ``k_affines`` None: none), all at ``rows``' positions, in place on
        x [n, hidden]. Returns None, or where the last layer has no FFN its FFN's input [n, hidden]."""
        if not len(rope) == len(k_pools) == len(v_pools) == self._count:
            raise ValueError("run_layer_stack: one rope pair and one K and V pool per layer")
        k_ptrs, v_ptrs, kv_types, affine_ptrs = self._pool_args(k_pools, v_pools, k_affines)
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
            x.data_ptr(),
            x.shape[0],
            self.hidden,
            self._descs,
            self._count,
            self._pointers(cos.data_ptr() for cos, _ in rope),
            self._pointers(sin.data_ptr() for _, sin in rope),
            k_ptrs,
            v_ptrs,
            *rows.args(),
            scale,
            work.data_ptr(),
            *kv_types,
            *rows.mirror_args(),
            affine_ptrs,
        )
        if self.layers[-1].ffn_kind == "none":  # fd_layer left the FFN's input in the work's first rows
            return work[: x.shape[0] * self.hidden].view(x.shape[0], self.hidden)
        return None


def run_layer_stack(
    layers: Sequence[DecoderLayerKernel],
    x: torch.Tensor,
    rope: Sequence[tuple[torch.Tensor, torch.Tensor]],
    k_pools: Sequence[torch.Tensor],
    v_pools: Sequence[torch.Tensor],
    rows: PagedRows,
    scale: float,
    work: torch.Tensor | None = None,
    k_affines: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Run decoder layers one after another in place on x [n, hidden] (see :class:`LayerStack`,
    which a caller running the same layers every pass should keep instead)."""
    if len({len(layers), len(rope), len(k_pools), len(v_pools)}) != 1:
        raise ValueError("run_layer_stack: one rope pair and one K and V pool per layer")
    if layers:
        LayerStack(layers)(x, rope, k_pools, v_pools, rows, scale, work, k_affines)
