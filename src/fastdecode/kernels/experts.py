"""A mixture of experts' FFN in one C call (``experts.c``'s ``fd_experts``): :class:`ExpertsKernel`.

Given n rows [n, hidden] and the router's choice for each (expert ids and weights [n, k], made by the
caller in float32), it runs every active expert's gate_up (+ bias) -> act(gate) * up (or gpt-oss's clamped
SwiGLU, :func:`~fastdecode.kernels.ops.clamped_glu`) -> down (+ bias) over the rows routed
to it, each row's activations quantized once, and adds each row's k outputs times their weights in rank
order 0 .. k - 1: the bits of the per-op path (``backends/ffn.py``'s ``ExpertsMLP`` over
:class:`~fastdecode.kernels.layer.Projection` and :func:`~fastdecode.kernels.ops.glu`), and a row's bits
never depend on the other rows of the call. Threads split the work over (expert, tile of outputs)
items, so one decoded row keeps every thread busy.

Every expert's projections must be in a block format (:data:`~fastdecode.kernels.abi.EXPERT_FORMATS`;
a bias or none, each its own): :func:`experts_unsupported` says why one is not, and a caller then keeps the
per-op path.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch

from fastdecode.kernels.abi import (
    EXPERT_FORMATS,
    EXPERTS_CLAMPED,
    GLU_ACTIVATIONS,
    IMPLS,
    MAX_TOP_K,
    ROUTINGS,
    WEIGHT_FORMATS,
    CExperts,
    CMoE,
)
from fastdecode.kernels.layer import Projection, _layer_projection
from fastdecode.kernels.library import kernel as _kernel

__all__ = ["ExpertsKernel", "MoEKernel", "experts_unsupported", "route_rows"]

_EXPERT_CODES = {WEIGHT_FORMATS[f]: f for f in EXPERT_FORMATS}


def experts_unsupported(projection) -> str | None:
    """None when ``projection`` (a :class:`Projection`) runs on the experts kernel, else why not."""
    if not isinstance(projection, Projection):
        return f"{type(projection).__name__} is not a C projection"
    for i in range(projection.struct.n_parts):
        if projection.struct.part[i].fmt not in _EXPERT_CODES:
            name = next(f for f, c in WEIGHT_FORMATS.items() if c == projection.struct.part[i].fmt)
            return f"{name} weights (the experts kernel takes {', '.join(EXPERT_FORMATS)})"
    return None


class ExpertsKernel:
    """Experts ``e = 0 .. E - 1``, each ``gate_up[e]`` [2 inter, hidden] (gate's rows, then up's) and
    ``down[e]`` [hidden, inter], as one C call. ``activation``: :data:`GLU_ACTIVATIONS`; ``clamp``:
    (alpha, limit) of gpt-oss's clamped SwiGLU in its place (``GatedMLP.clamp``); ``impl``
    (:data:`IMPLS`) overrides the projections' own (``auto``: the widest this CPU runs; every one gives
    the same bits)."""

    def __init__(
        self,
        gate_up: Sequence[Projection],
        down: Sequence[Projection],
        activation: str = "silu",
        impl: str = "auto",
        clamp: tuple[float, float] | None = None,
    ) -> None:
        if not gate_up or len(down) != len(gate_up):
            raise ValueError(f"ExpertsKernel: {len(gate_up)} gate_up and {len(down)} down projections")
        hidden, inter = gate_up[0].in_features, down[0].in_features
        for e, (gu, dn) in enumerate(zip(gate_up, down)):
            why = experts_unsupported(gu) or experts_unsupported(dn)
            if why is not None:
                raise ValueError(f"ExpertsKernel: expert {e}: {why}")
            shapes = ((gu.out_features, gu.in_features), (dn.out_features, dn.in_features))
            if shapes != ((2 * inter, hidden), (hidden, inter)):
                raise ValueError(
                    f"ExpertsKernel: expert {e} has gate_up {list(shapes[0])} and down {list(shapes[1])}, "
                    f"expected [{2 * inter}, {hidden}] and [{hidden}, {inter}] (expert 0's)"
                )
        if activation not in GLU_ACTIVATIONS:
            raise ValueError(f"ExpertsKernel: unknown activation {activation!r}; choose one of {GLU_ACTIVATIONS}")
        if clamp is not None and not (len(clamp) == 2 and all(math.isfinite(v) for v in clamp) and clamp[1] > 0):
            raise ValueError(f"ExpertsKernel: clamp must be (alpha, limit), finite, limit > 0, got {clamp!r}")
        if impl not in IMPLS:
            raise ValueError(f"ExpertsKernel: unknown implementation {impl!r}; choose one of {', '.join(IMPLS)}")
        self._kernel = _kernel()
        self.n_experts, self.hidden, self.inter = len(gate_up), hidden, inter
        self._projections = (list(gate_up), list(down))  # held: the C side points at their structs
        pointers = ctypes.c_void_p * self.n_experts
        self._gate_up = pointers(*(ctypes.addressof(p.struct) for p in gate_up))
        self._down = pointers(*(ctypes.addressof(p.struct) for p in down))
        alpha, limit = (0.0, 0.0) if clamp is None else clamp
        self._desc = CExperts(
            ctypes.addressof(self._gate_up),
            ctypes.addressof(self._down),
            self.n_experts,
            hidden,
            inter,
            GLU_ACTIVATIONS.index(activation) if clamp is None else EXPERTS_CLAMPED,
            IMPLS[impl],
            alpha,
            limit,
        )
        self._desc_ref = ctypes.byref(self._desc)
        self._work_bytes: dict[tuple[int, int], int] = {}
        # distinct experts run by the layer call (fd_layer's FFN_EXPERTS adds to it; :class:`MoEKernel`)
        self.runs = ctypes.c_int64(0)

    def work_bytes(self, n: int, k: int) -> int:
        """Bytes of work a call of n rows, k experts each, needs (asked of C once a shape)."""
        got = self._work_bytes.get((n, k))
        if got is None:
            got = self._work_bytes[(n, k)] = self._kernel.fd_experts_work_bytes(self._desc_ref, n, k)
        return got

    def __call__(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, int]:
        """x [n, hidden] float32, index [n, k] (expert ids, any integer dtype), weights [n, k] float32 ->
        (out [n, hidden] float32, the number of distinct experts run)."""
        x, index, weights = self._checked(x, index, weights)
        n, k = index.shape
        out = torch.empty(n, self.hidden, dtype=torch.float32)
        work = torch.empty(max(1, self.work_bytes(n, k)), dtype=torch.uint8)
        run = self._kernel.fd_experts(
            self._desc_ref,
            x.data_ptr(),
            n,
            k,
            index.data_ptr(),
            weights.data_ptr(),
            work.data_ptr(),
            out.data_ptr(),
        )
        if run < 0:
            bad = index[(index < 0) | (index >= self.n_experts)][0]
            raise ValueError(f"ExpertsKernel: expert index {int(bad)} is not one of the {self.n_experts} experts")
        return out, run

    def _checked(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(
                f"ExpertsKernel: x must be float32 CPU rows [n, {self.hidden}], got {x.dtype} {list(x.shape)} "
                f"on {x.device.type}"
            )
        if index.dim() != 2 or index.shape[0] != x.shape[0] or not 1 <= index.shape[1] <= self.n_experts:
            raise ValueError(
                f"ExpertsKernel: index must be [{x.shape[0]}, k] with 1 <= k <= {self.n_experts}, "
                f"got {list(index.shape)}"
            )
        if weights.shape != index.shape or weights.dtype != torch.float32 or weights.device.type != "cpu":
            raise ValueError(
                f"ExpertsKernel: weights must be float32 CPU [{', '.join(map(str, index.shape))}], "
                f"got {weights.dtype} {list(weights.shape)}"
            )
        if index.dtype.is_floating_point or index.dtype == torch.bool or index.device.type != "cpu":
            raise ValueError(f"ExpertsKernel: index must be integer expert ids on the CPU, got {index.dtype}")
        return x.contiguous(), index.to(torch.int64).contiguous(), weights.contiguous()


def _check_routing(who: str, routing: str, top_k: int, n_experts: int) -> None:
    """A routing ``fd_route_f32`` runs: one of :data:`ROUTINGS`, 1 <= top_k <= n_experts (and MAX_TOP_K)."""
    if routing not in ROUTINGS or not 1 <= top_k <= min(n_experts, MAX_TOP_K):
        raise ValueError(f"{who}: routing {routing!r} of top {top_k} of {n_experts} experts is not one it runs")


def route_rows(logits: torch.Tensor, top_k: int, routing: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice by ``experts.c``'s ``fd_route_f32``: logits [n, E] float32 (CPU; not modified) ->
    (weights [n, k] float32, expert ids [n, k] int64), rank 0 the largest, a tie to the lower expert, each row
    alone; ``routing`` one of :data:`ROUTINGS` (softmax then top k, optionally renormalised; or top k then
    softmax). The arithmetic fd_layer's experts FFN does in C, so the per-op path and the layer call agree
    bit for bit; torch's own softmax is a vectorised kernel whose bits C cannot reproduce."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        raise ValueError(f"route_rows: logits must be float32 CPU [n, E], got {logits.dtype} {list(logits.shape)}")
    n, n_experts = logits.shape
    _check_routing("route_rows", routing, top_k, n_experts)
    work = logits.contiguous().clone()  # fd_route_f32 overwrites its logits with their softmax
    weights = torch.empty(n, top_k, dtype=torch.float32)
    index = torch.empty(n, top_k, dtype=torch.int64)
    _kernel().fd_route_f32(
        work.data_ptr(),
        n,
        n_experts,
        top_k,
        ROUTINGS.index(routing),
        int(renormalize),
        weights.data_ptr(),
        index.data_ptr(),
    )
    return weights, index


class MoEKernel:
    """A mixture of experts' FFN (no shared expert) as a layer call runs it (``fd_layer``'s FFN_EXPERTS,
    ``experts.c``'s ``fd_moe``): ``router`` a float32 :class:`Projection` [n_experts, hidden] (its bias or
    none), or the ``(weight, scales, bias)`` a linear's ``layer_projection`` gives (made one as
    :class:`~fastdecode.kernels.layer.DecoderLayerKernel` makes its projections), :func:`route_rows`' choice
    of ``top_k`` by ``routing``, then ``experts``. The C description
    (``desc``) points at the router's and the experts' structs, held here; the experts run are added to
    ``experts.runs``."""

    def __init__(self, router, experts: ExpertsKernel, top_k: int, routing: str, renormalize: bool) -> None:
        router = _layer_projection("router", router, experts.hidden)
        if router.blocks or router.struct.n_parts != 1 or router.struct.part[0].fmt != WEIGHT_FORMATS["f32"]:
            raise ValueError("MoEKernel: the router must be one float32 projection")
        if (router.out_features, router.in_features) != (experts.n_experts, experts.hidden):
            raise ValueError(
                f"MoEKernel: a router [{router.out_features}, {router.in_features}] for {experts.n_experts} experts "
                f"of hidden {experts.hidden}"
            )
        _check_routing("MoEKernel", routing, top_k, experts.n_experts)
        self.router, self.experts, self.top_k = router, experts, top_k
        self.desc = CMoE(
            ctypes.addressof(router.struct),
            ctypes.addressof(experts._desc),
            top_k,
            ROUTINGS.index(routing),
            int(renormalize),
            ctypes.addressof(experts.runs),
        )
