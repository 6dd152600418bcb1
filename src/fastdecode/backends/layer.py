"""One decoder layer, described once and run by one function per backend.

:class:`DecoderLayer` is the description: a layer's weights (its projections as the
callables ``native_weights`` builds, its norms, None where it has no such part) and
its shape and variant (query and key norms per head or over the projection, sliding
window, RoPE table, residual multiplier), made from a transformers layer and its
:class:`~fastdecode.architectures.DecoderArch` by :func:`build_layer`. The FFN is an
object of its own kind (``backends/ffn.py``: :class:`GatedMLP`, :class:`ExpertsMLP`):
the layer calls it and never looks inside.

Two consumers, one description:

* the torch path, :func:`forward`: the layer's steps written once, over the operations
  of :class:`TorchOps` (torch, any dtype and device) or :class:`KernelOps`
  (fastdecode's float32 CPU kernels called one at a time: under H2O, which reads each
  layer's queries, or where a projection is not on a C GEMM);
* the C path, :func:`layer_kernel`: the same description as ``kernels/cpu.c``'s
  ``fd_layer_desc``, run a pass at a time by ``fd_layer_stack``, in the same order as
  :class:`KernelOps`, so both give the same bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdecode.architectures import DecoderArch
from fastdecode.backends.ffn import FFN_KINDS, ExpertsMLP, GatedMLP, route
from fastdecode.backends.native_weights import Linear, NativeLinears
from fastdecode.kernels.cpu import (
    DecoderLayerKernel,
    PagedRows,
    attention_rows,
    clamped_glu,
    glu,
    kv_mirror,
    qk_rms_norm_,
    rms_norm,
    rope_qkv,
)
from fastdecode.kernels.experts import route_rows
from fastdecode.kernels.kv_formats import pool_format


@dataclass
class DecoderLayer:
    """A decoder layer of the native decoder. Every norm weight comes with ``DecoderArch.norm_offset``
    added: [hidden] for the branch norms, [head_dim] for the query and key norms of kind ``"head"``,
    [H * head_dim] and [KV * head_dim] for kind ``"proj"``."""

    qkv: Linear  # hidden -> (n_heads + 2 * n_kv) * head_dim
    o: Linear  # n_heads * head_dim -> hidden
    ffn: GatedMLP | ExpertsMLP
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    attn_norm: torch.Tensor | None = None  # before attention
    post_attn_norm: torch.Tensor | None = None  # on the attention's output, before the residual add
    mlp_norm: torch.Tensor | None = None  # before the FFN
    post_mlp_norm: torch.Tensor | None = None  # on the FFN's output
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm: str = "head"  # "head": each head's vector; "proj": the whole projection
    window: int | None = None  # sliding window in positions; None: the whole context
    rope: str | None = None  # the key of its RoPE table (arch.NOPE: cos 1, sin 0)
    residual_scale: float = 1.0  # multiplies each branch before its residual add
    softcap: float | None = None  # attention scores s -> softcap * tanh(s / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None  # float32 [n_heads]: each head's attention sink (gpt-oss), a logit in the
    # softmax's denominator only

    @property
    def gate_up(self) -> Linear:
        return self.ffn.gate_up

    @property
    def down(self) -> Linear:
        return self.ffn.down

    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.o, *self.ffn.linears())

    def norms(self) -> list[torch.Tensor]:
        norms = (self.attn_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm, self.q_norm, self.k_norm)
        return [t for t in norms if t is not None]


def build_layer(
    module: torch.nn.Module, index: int, arch: DecoderArch, linears: NativeLinears, norm, shape: tuple
) -> DecoderLayer:
    """Decoder layer ``index`` of a transformers model (``module``: its ``layers[index]``) as ``arch``
    describes it, its projections from ``linears``, each norm weight through ``norm`` (the offset added);
    ``shape``: (n_heads, n_kv, head_dim, eps)."""
    parts = arch.parts
    get = module.get_submodule

    def weight(path: str | None) -> torch.Tensor | None:
        return None if path is None else norm(get(path).weight)

    sinks = None if parts.sinks is None else module.get_parameter(parts.sinks).detach().float().contiguous()

    return DecoderLayer(
        qkv=linears([get(p) for p in parts.qkv]),
        o=linears([get(parts.o)]),
        ffn=FFN_KINDS[arch.ffn_kind(index)](module, arch, linears),
        n_heads=shape[0],
        n_kv=shape[1],
        head_dim=shape[2],
        eps=shape[3],
        attn_norm=weight(parts.attn_norm),
        post_attn_norm=weight(parts.post_attn_norm),
        mlp_norm=weight(parts.mlp_norm),
        post_mlp_norm=weight(parts.post_mlp_norm),
        q_norm=weight(parts.q_norm),
        k_norm=weight(parts.k_norm),
        qk_norm=arch.qk_norm or "head",
        window=arch.window(index),
        rope=arch.rope_key(index),
        residual_scale=arch.residual_scale,
        softcap=arch.attn_softcap,
        sinks=sinks,
    )


# The DecoderLayer fields fd_layer_desc expresses; a layer setting any other field away from its default
# (a part added for an architecture fd_layer does not run) keeps the per-op path.
_C_FIELDS = frozenset(
    ("qkv", "o", "ffn", "n_heads", "n_kv", "head_dim", "eps", "attn_norm", "post_attn_norm", "mlp_norm")
    + ("post_mlp_norm", "q_norm", "k_norm", "qk_norm", "window", "rope", "residual_scale", "softcap", "sinks")
)


def _beyond_c(layer: DecoderLayer) -> list[str]:
    """The fields of ``layer`` set that fd_layer does not express."""
    out = []
    for f in dataclasses.fields(layer):
        if f.name in _C_FIELDS:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(layer, f.name)
        if not (value is default or (not isinstance(value, torch.Tensor) and value == default)):
            out.append(f.name)
    return out


def layer_kernel(layer: DecoderLayer) -> DecoderLayerKernel | None:
    """``layer`` as one C call (``fd_layer``), where every projection is on a row-invariant C GEMM
    (float32, int8, block formats) and fd_layer expresses every part the layer has; else None (the layer
    then runs through :class:`KernelOps`). An experts layer whose experts run as one C call
    (``ExpertsMLP.fused``: block weights, gpt-oss's biased, clamped experts included) is one call, router
    and top-k too (kind ``experts``, ``ExpertsMLP.layer_kernel``); with a shared expert its C call is its
    attention half (an FFN of kind ``none``): the call returns the FFN's input and :func:`ffn_branch` runs
    the FFN. A gated FFN's clamped SwiGLU (``GatedMLP.clamp``) has no fd_layer form:
    such a layer keeps the per-op path."""
    if layer.ffn.kind not in ("gated", "experts") or _beyond_c(layer) or getattr(layer.ffn, "clamp", None) is not None:
        return None
    linears = layer.linears() if layer.ffn.kind == "gated" else (layer.qkv, layer.o)
    projections = [getattr(f, "layer_projection", lambda: None)() for f in linears]
    if any(p is None for p in projections):
        return None
    moe = layer.ffn.layer_kernel() if layer.ffn.kind == "experts" else None
    qkv, o, gate_up, down = projections + [None] * (4 - len(projections))
    return DecoderLayerKernel(
        layer.attn_norm,
        qkv,
        o,
        layer.mlp_norm,
        gate_up,
        down,
        layer.n_heads,
        layer.n_kv,
        layer.head_dim,
        layer.eps,
        layer.q_norm,
        layer.k_norm,
        layer.post_attn_norm,
        layer.post_mlp_norm,
        layer.ffn.activation if layer.ffn.kind == "gated" else "silu",
        layer.window,
        qk_norm=layer.qk_norm,
        residual_scale=layer.residual_scale,
        softcap=layer.softcap,
        sinks=layer.sinks,
        moe=moe,
    )


def forward(
    layer: DecoderLayer, ops, x, k_pool, v_pool, rows: PagedRows, cos, sin, scale: float, observe=None, affine=None
) -> torch.Tensor:
    """One decoder layer on x [n, hidden]: its keys and values written into the pools at ``rows``'
    positions (cos, sin [n, head_dim]: the rows' RoPE), its queries shown to ``observe`` (H2O),
    ``affine`` the keys' (the cache's). The order of ``fd_layer`` (kernels/cpu.c)."""
    h = x if layer.attn_norm is None else ops.norm(x, layer.attn_norm)
    out = ops.attend(layer, ops.linear(layer.qkv, h), k_pool, v_pool, rows, cos, sin, scale, observe, affine)
    x = _residual(ops, layer, x, ops.linear(layer.o, out), layer.post_attn_norm)
    return ffn_branch(layer, ops, x, x if layer.mlp_norm is None else ops.norm(x, layer.mlp_norm))


def ffn_branch(layer: DecoderLayer, ops, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The FFN's branch of ``layer`` added to the residual stream x [n, hidden]; h [n, hidden]: the FFN's
    input (x through ``mlp_norm``: :func:`forward`'s, or the attention half's C call's, the same bits)."""
    return _residual(ops, layer, x, layer.ffn(ops, h), layer.post_mlp_norm)


def _residual(ops, layer: DecoderLayer, x: torch.Tensor, h: torch.Tensor, post_norm) -> torch.Tensor:
    if post_norm is not None:
        h = ops.norm(h, post_norm)
    return x + (h if layer.residual_scale == 1.0 else h * layer.residual_scale)


class KernelOps:
    """fastdecode's float32 CPU kernels, one call each; projections through ``lin`` (the target's
    row-invariant call: low-bit modules may be on torch's kernels). ``fused_ffn``: an FFN may run its
    C form (``ExpertsMLP.fused``), the bits of these calls one by one."""

    fused_ffn = True

    def __init__(self, lin, eps: float) -> None:
        self.lin, self.eps = lin, eps

    def linear(self, f: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.lin(f, x).contiguous()

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def glu(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return glu(gate_up, activation)

    def clamped_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        return clamped_glu(gate_up, alpha, limit)

    def route(self, logits: torch.Tensor, routing) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice in C (the layer call's arithmetic: the same bits on both paths)."""
        return route_rows(logits.float(), routing.top_k, routing.gating, routing.renormalize)

    def attend(self, layer: DecoderLayer, qkv, k_pool, v_pool, rows, cos, sin, scale, observe, affine):
        """[n, (H + 2 KV) D] -> the attention's output [n, H * D], the keys and values stored."""
        H, KV, D = layer.n_heads, layer.n_kv, layer.head_dim
        if layer.q_norm is not None:
            qk_rms_norm_(qkv, H, KV, D, layer.q_norm, layer.k_norm, self.eps, layer.qk_norm)
        q = rope_qkv(qkv, H, KV, D, cos.contiguous(), sin.contiguous(), k_pool, v_pool, 0, rows, affine)  # [n, H, D]
        kv_mirror(k_pool, v_pool, rows, D)
        if observe is not None:
            observe(q, k_pool, layer.window, v_pool, affine)
        return attention_rows(
            q,
            k_pool,
            v_pool,
            0,
            scale,
            layer.window,
            rows=rows,
            k_affine=affine,
            softcap=layer.softcap,
            sinks=layer.sinks,
        )


class TorchOps:
    """torch's operations, any dtype and device, in transformers' order of operations; attention one
    query row at a time (a decode step's SDPA call: SDPA is not row-invariant across query counts)."""

    def __init__(self, lin, eps: float, norm_in_float32: bool) -> None:
        self.lin, self.eps, self.norm_in_float32 = lin, eps, norm_in_float32

    def linear(self, f: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.lin(f, x)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm; Gemma's and OLMo 2's apply the weight in float32, then cast
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_in_float32:
            return (h * weight).to(x.dtype)
        return weight * h.to(x.dtype)

    def glu(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up

    def clamped_glu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        # transformers' GptOssExperts._apply_gate, gate and up side by side (not interleaved)
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def route(self, logits: torch.Tensor, routing) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, routing)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: DecoderLayer, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [H, n, D], k [KV, n, D] normalised (when the layer does), v [n, KV, D]."""
        n, H, KV, D = qkv.shape[0], layer.n_heads, layer.n_kv, layer.head_dim
        if layer.q_norm is not None and layer.qk_norm == "proj":
            q_k = (self.norm(qkv[:, : H * D], layer.q_norm), self.norm(qkv[:, H * D : (H + KV) * D], layer.k_norm))
            qkv = torch.cat([*q_k, qkv[:, (H + KV) * D :]], dim=1)
        q = qkv[:, : H * D].view(n, H, D).transpose(0, 1)
        k = qkv[:, H * D : (H + KV) * D].view(n, KV, D).transpose(0, 1)
        v = qkv[:, (H + KV) * D :].view(n, KV, D)
        if layer.q_norm is not None and layer.qk_norm == "head":
            q, k = self.norm(q, layer.q_norm), self.norm(k, layer.k_norm)
        return q, k, v

    def attend(self, layer: DecoderLayer, qkv, k_pool, v_pool, rows: PagedRows, cos, sin, scale, observe, affine):
        """[n, (H + 2 KV) D] -> the attention's output [n, H * D], the keys and values stored."""
        n, H, D, B = qkv.shape[0], layer.n_heads, layer.head_dim, rows.block_size
        q, k, v = self._qkv(layer, qkv)
        cos, sin = cos.to(qkv.device), sin.to(qkv.device)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        seq, tables = rows.seq.to(qkv.device), rows.tables.to(qkv.device)
        self._store(k_pool, v_pool, k.transpose(0, 1), v, rows, affine)
        if observe is not None:
            observe(q.transpose(0, 1), k_pool, layer.window, v_pool, affine)
        kf, vf = pool_format(k_pool, D), pool_format(v_pool, D)
        out = []
        for i in range(n):
            p = int(rows.pos[i])
            lo = 0 if layer.window is None else max(0, p + 1 - layer.window)
            t = torch.arange(lo, p + 1, device=qkv.device)
            tb = tables[seq[i], t // B]
            kk = kf.load(k_pool[tb, :, t % B], affine).transpose(0, 1)[None].to(q.dtype)  # [1, KV, L, D]
            vv = vf.load(v_pool[tb, :, t % B]).transpose(0, 1)[None].to(q.dtype)
            out.append(
                self._attend_row(q[None, :, i : i + 1], kk, vv, scale, layer.softcap, layer.sinks)
            )  # [1, H, 1, D]
        return torch.cat(out, dim=2)[0].transpose(0, 1).reshape(n, H * D)

    @staticmethod
    def _attend_row(q, k, v, scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query row: q [1, H, 1, D] over k, v [1, KV, L, D] -> [1, H, 1, D]."""
        if softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        # SDPA has neither soft caps nor sinks: transformers' eager attention (Gemma 2's, gpt-oss's)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if sinks is None:
            return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
        s = torch.cat([s, sinks.to(s.device, s.dtype).view(1, -1, 1, 1)], dim=-1)  # the sink: one more logit
        s = s - s.max(dim=-1, keepdim=True).values
        return torch.matmul(torch.softmax(s, dim=-1, dtype=s.dtype)[..., :-1].to(q.dtype), v)

    @staticmethod
    def _store(k_pool, v_pool, k, v, rows: PagedRows, affine) -> None:
        """k, v [n, KV, D] written at ``rows``' positions, and copied to the tree paths' mirrors (cpu.c's
        fd_kv_mirror)."""
        D, B, device = k.shape[-1], rows.block_size, k.device
        pos, seq, tables = rows.pos.to(device), rows.seq.to(device), rows.tables.to(device)
        blk, off = tables[seq, pos // B], pos % B  # [n]
        kf, vf = pool_format(k_pool, D), pool_format(v_pool, D)  # a drafter may run in the target's cache
        k_pool[blk, :, off] = kf.store(k, affine)
        v_pool[blk, :, off] = vf.store(v)
        if rows.mirrors is not None and rows.mirrors.numel():
            src, dst_seq, dst_pos = rows.mirrors.to(device).unbind(1)
            dst_blk, dst_off = tables[dst_seq, dst_pos // B], dst_pos % B
            k_pool[dst_blk, :, dst_off] = k_pool[blk[src], :, off[src]]
            v_pool[dst_blk, :, dst_off] = v_pool[blk[src], :, off[src]]
