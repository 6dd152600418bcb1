"""The FFN kinds of the native decoder layer, one object each: the layer calls ``ffn(ops, h)`` and never
looks inside (``backends/layer.py``). :data:`FFN_KINDS` maps :attr:`DecoderArch.ffn` to its builder.

* :class:`GatedMLP` (``"gated"``): down(act(gate) * up), or gpt-oss's clamped SwiGLU
  (``DecoderArch.glu_clamp``).
* :class:`ExpertsMLP` (``"experts"``, mixture of experts; mlx-lm's ``SwitchGLU``, llama.cpp's
  ``build_moe_ffn``): every MoE architecture's, its routing given by
  :class:`~fastdecode.architectures.Experts` (Qwen2/3-MoE, OLMoE: softmax then top-k, optionally
  renormalized; Mixtral, gpt-oss: top-k logits then softmax; Qwen2-MoE's shared expert; gpt-oss's biased
  router and experts, stored interleaved: ``LayerParts.experts_layout``).

Where every expert's projections are in a block format the C kernels run (``--weights gguf`` on a MoE
GGUF, ``q8_0``, ``q4_0``, ...) and the layer runs on fastdecode's kernels (:class:`KernelOps`), the experts
after the router are one C call (``kernels/experts.py``'s :class:`ExpertsKernel`: ``experts.c``), the per-op
path's bits; elsewhere (float or int8 weights, torch's ops, CUDA) the per-op path below. The router and
the shared expert stay in Python either way: the layer's attention half is one ``fd_layer`` call (an FFN of
kind ``none``, ending its run of C layers), then this FFN runs (``backends/layer.py``'s ``ffn_branch``);
taking the router into C too would need its softmax and sort bit for bit torch's.

Row invariance (a row's bits never depend on the other rows of a pass): the router is a float32
projection on the row-invariant linear, its softmax and top-k are per row (a stable sort: ties go to
the lower expert); each active expert runs once over the rows routed to it, on the same row-invariant
linears as a dense layer, its outputs scattered to slot [row, rank] of a [rows, top_k, hidden] buffer;
each row then adds its k slots in rank order. Which other rows share an expert's call changes nothing
of a row's bits (``tests/backends/test_moe.py`` checks a row alone, among 8 and among 70).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fastdecode.architectures import DecoderArch, Experts, Unsupported
from fastdecode.backends.native_weights import Linear, NativeLinears
from fastdecode.formats.float import make_float_linear
from fastdecode.kernels.abi import GLU_ACTIVATIONS
from fastdecode.kernels.experts import ExpertsKernel, MoEKernel, experts_unsupported
from fastdecode.loaders.gguf_model import ATTR, EXPERTS_ATTR


@dataclass
class GatedMLP:
    """The FFN of kind ``"gated"``: down(act(gate) * up), gate and up one projection."""

    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    inter: int = 0  # intermediate size (down's in_features)
    clamp: tuple[float, float] | None = None  # (alpha, limit): gpt-oss's clamped SwiGLU (DecoderArch.glu_clamp)
    kind: ClassVar[str] = "gated"

    def linears(self) -> tuple[Linear, ...]:
        return (self.gate_up, self.down)

    def probe_layers(self, hidden: int) -> list[tuple[Linear, int]]:
        """(linear, in_features) of what a row-invariance probe should call."""
        return [(self.gate_up, hidden), (self.down, self.inter)]

    def __call__(self, ops, h: torch.Tensor) -> torch.Tensor:
        gate_up = ops.linear(self.gate_up, h)
        if self.clamp is not None:
            return ops.linear(self.down, ops.clamped_glu(gate_up, *self.clamp))
        return ops.linear(self.down, ops.glu(gate_up, self.activation))


def route(logits: torch.Tensor, experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [n, n_experts] float32 -> (weights [n, k] float32, expert index [n, k] int64), rank
    0 the largest; each row alone."""
    k = experts.top_k
    if experts.gating == "softmax_topk":
        probs = torch.softmax(logits, dim=-1)
        top, index = probs.sort(dim=-1, descending=True, stable=True)
        top, index = top[:, :k], index[:, :k]
        if experts.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, index
    top, index = logits.sort(dim=-1, descending=True, stable=True)  # "topk_softmax"
    return torch.softmax(top[:, :k], dim=-1), index[:, :k]


@dataclass
class ExpertsMLP:
    """The FFN of kind ``"experts"``: each row's top-k experts (gated MLPs) weighted by the router, plus
    an optional shared expert scaled by sigmoid(shared_gate . h)."""

    router: Linear  # float32: hidden -> n_experts
    experts: list[GatedMLP]
    routing: Experts
    shared: GatedMLP | None = None
    shared_gate: Linear | None = None  # float32: hidden -> 1
    # the routed experts as one C call (``_fused_experts``), taken where the ops are fastdecode's kernels
    fused: ExpertsKernel | None = field(default=None, compare=False)
    # distinct experts run since the counter was last taken (``take_experts_run``): what a pass's cost
    # grows with (each runs its weights once, over its rows); a count, read by the engine's cost model
    experts_run: int = field(default=0, init=False, compare=False)
    kind: ClassVar[str] = "experts"

    @property
    def activation(self) -> str:
        return self.experts[0].activation

    def linears(self) -> tuple[Linear, ...]:
        shared = () if self.shared is None else (*self.shared.linears(), self.shared_gate)
        return (self.router, *(f for e in self.experts for f in e.linears()), *shared)

    def probe_layers(self, hidden: int) -> list[tuple[Linear, int]]:
        return [(self.router, hidden), *self.experts[0].probe_layers(hidden)]

    def __call__(self, ops, h: torch.Tensor) -> torch.Tensor:
        weights, index = ops.route(ops.linear(self.router, h), self.routing)  # [n, k] each, float32
        weights = weights.to(h.dtype)
        if self.fused is not None and getattr(ops, "fused_ffn", False):  # the same bits, one C call
            out, run = self.fused(h, index, weights)
            self.experts_run += run
        else:
            out = self._routed(ops, h, index, weights)
        if self.shared is not None:
            gate = torch.sigmoid(ops.linear(self.shared_gate, h)).to(h.dtype)  # [n, 1]
            out = out + gate * self.shared(ops, h)
        return out

    def _routed(self, ops, h: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts on the per-op path: each active expert once over its rows, each row's k
        outputs added in rank order."""
        n, hidden, k = h.shape[0], h.shape[1], self.routing.top_k
        slots = h.new_zeros(n, k, hidden)  # [rows, top_k, hidden]: each row's experts' outputs, by rank
        active = torch.unique(index).tolist()  # ascending expert ids
        self.experts_run += len(active)
        for e in active:
            rows, rank = (index == e).nonzero(as_tuple=True)
            slots[rows, rank] = self.experts[e](ops, h[rows].contiguous()) * weights[rows, rank, None]
        out = slots[:, 0]
        for j in range(1, k):  # rank order, whatever the experts
            out = out + slots[:, j]
        return out

    def layer_kernel(self) -> MoEKernel | None:
        """The FFN as a layer call's (fd_layer's FFN_EXPERTS: router, top-k and experts in C, the bits of
        :meth:`__call__` on fastdecode's kernels), where the experts run as one C call and the router on the
        float32 row-invariant GEMM; None with a shared expert (it stays per-op) or otherwise."""
        router = getattr(self.router.linear, "layer_projection", lambda: None)()
        if self.fused is None or self.shared is not None or router is None:
            return None
        if router[1] is not None:  # int8 scales: not the float32 router fd_moe takes
            return None
        r = self.routing
        return MoEKernel(router, self.fused, r.top_k, r.gating, r.renormalize)


def take_experts_run(ffns) -> int:
    """The distinct experts the experts FFNs among ``ffns`` ran since last taken (per op, or in a layer
    call: the experts kernel's counter), summed; counters reset."""
    total = 0
    for ffn in ffns:
        if isinstance(ffn, ExpertsMLP):
            total, ffn.experts_run = total + ffn.experts_run, 0
            if ffn.fused is not None:
                total, ffn.fused.runs.value = total + ffn.fused.runs.value, 0
    return total


def _gated_mlp(module: torch.nn.Module, arch: DecoderArch, linears: NativeLinears) -> GatedMLP:
    get = module.get_submodule
    down = get(arch.parts.down)
    gate_up = linears([get(p) for p in arch.parts.gate_up])
    return GatedMLP(gate_up, linears([down]), arch.activation, down.in_features, arch.glu_clamp)


def _view_linear(weight: torch.Tensor, ref=None, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    """An ``nn.Linear`` over ``weight`` [out, in] (a view of a 3-D experts tensor, not a copy), so every
    weight format builds an expert's projection as it builds a dense one; ``ref``: where a skeleton's
    expert lies in its file; ``bias`` [out]: the expert's (gpt-oss)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    if ref is not None:
        setattr(linear, ATTR, ref)
    return linear


class Float32Linear:
    """A router's projection: float32 weights (whatever the weight format), its input widened to float32;
    on the row-invariant GEMM where it runs (a CPU), else ``F.linear`` (row groups probed as any linear's)."""

    def __init__(self, weight: torch.Tensor, float_kernel: str, bias: torch.Tensor | None = None) -> None:
        self.linear = make_float_linear(weight, bias, "torch" if float_kernel == "torch" else "auto")
        self.row_invariant = getattr(self.linear, "row_invariant", False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float())

    def weight_bytes(self) -> int:
        return self.linear.weight_bytes()


def _float32_linear(module: torch.nn.Module, float_kernel: str) -> Float32Linear:
    """A router's projection from its module: its weight (and bias: gpt-oss's), or a skeleton's from its file."""
    ref = getattr(module, ATTR, None)
    weight = ref.float_weight() if ref is not None else module.weight.detach()
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().float().reshape(-1).contiguous()
    return Float32Linear(weight.reshape(-1, weight.shape[-1]).float().contiguous(), float_kernel, bias)


def _expert_weights(experts: torch.nn.Module, layout: str) -> tuple[torch.Tensor, ...]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I], gate, up and down biases or None) of a 3-D experts
    module as ``LayerParts.experts_layout`` says it lies: views where its layout is ours ("stacked"); copies
    of gpt-oss's ("interleaved": [E, H, 2 I] with gate and up in alternate columns; on a skeleton's meta
    tensors, shapes only)."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if layout == "stacked":  # [E, 2I, H], [E, H, I]
        inter = gate_up.shape[1] // 2
        return gate_up[:, :inter], gate_up[:, inter:], down, None, None, None
    if gate_up.dim() != 3 or gate_up.shape[-1] % 2:
        raise Unsupported(f"interleaved experts of shape {list(gate_up.shape)} are not [E, hidden, 2 * I]")
    gate, up = (gate_up[..., i::2].transpose(1, 2).contiguous() for i in (0, 1))  # [E, I, H]
    bias, down_bias = experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach()
    return gate, up, down.transpose(1, 2).contiguous(), bias[:, 0::2], bias[:, 1::2], down_bias


def _expert_mlps(experts: torch.nn.Module, arch: DecoderArch, linears: NativeLinears) -> list[GatedMLP]:
    gate, up, down, *biases = _expert_weights(experts, arch.parts.experts_layout)
    n, inter = arch.experts.n_experts, down.shape[-1]
    if not (gate.shape == up.shape == (n, inter, down.shape[1]) and down.shape[0] == n):
        raise Unsupported(
            f"experts of shape {list(gate.shape)} (gate), {list(up.shape)} (up) and {list(down.shape)} (down) are "
            f"not {n} experts of gate and up [I, hidden], down [hidden, I]"
        )
    refs = getattr(experts, EXPERTS_ATTR, None)  # a skeleton's: per expert, where gate, up and down lie
    out = []
    for e in range(n):
        views = [
            _view_linear(w[e], None if refs is None else refs[i][e], None if b is None else b[e])
            for i, (w, b) in enumerate(zip((gate, up, down), biases))
        ]
        out.append(GatedMLP(linears(views[:2]), linears(views[2:]), arch.activation, inter, arch.glu_clamp))
    return out


def _experts_mlp(module: torch.nn.Module, arch: DecoderArch, linears: NativeLinears) -> ExpertsMLP:
    parts, routing, get = arch.parts, arch.experts, module.get_submodule
    if routing is None:
        raise Unsupported("an experts FFN without its routing (DecoderArch.experts)")
    float_kernel = linears.float_kernel
    shared = shared_gate = None
    if routing.shared_expert:
        down = get(parts.shared_down)
        gate_up = linears([get(p) for p in parts.shared_gate_up])
        shared = GatedMLP(gate_up, linears([down]), arch.activation, down.in_features)
        shared_gate = _float32_linear(get(parts.shared_gate), float_kernel)
    experts = _expert_mlps(get(parts.experts), arch, linears)
    return ExpertsMLP(
        router=_float32_linear(get(parts.router), float_kernel),
        experts=experts,
        routing=routing,
        shared=shared,
        shared_gate=shared_gate,
        fused=_fused_experts(experts),
    )


def _fused_experts(experts: list[GatedMLP]) -> ExpertsKernel | None:
    """The experts as one C call where every expert's projections run there (block formats, with their biases
    and gpt-oss's clamped SwiGLU), else None."""
    if any(getattr(e, "activation", None) not in GLU_ACTIVATIONS for e in experts):  # a variant it does not run
        return None
    projections = [[getattr(f, "layer_projection", lambda: None)() for f in e.linears()] for e in experts]
    if any(p is None or experts_unsupported(p) for pair in projections for p in pair):
        return None
    gate_up, down = [gu for gu, _ in projections], [dn for _, dn in projections]
    return ExpertsKernel(gate_up, down, experts[0].activation, clamp=experts[0].clamp)


# DecoderArch.ffn -> the builder of that kind of FFN from a transformers layer
FFN_KINDS = {"gated": _gated_mlp, "experts": _experts_mlp}
