"""Per-input-channel scaling folded into the operation before a group of linear layers.

For linears reading one input X [tokens, in_features] and scales s [in_features] > 0,

    Y = X W^T = (X / s) (W * s)^T,     W * s scaling W's columns,

so the float model is unchanged when the operation that produces X is made to produce
X / s. AWQ (Lin et al.) and SmoothQuant (Xiao et al.) both choose s and fold it so; what
they fold into, per decoder layer (:func:`smoothing_groups`; where each part lies, and the
norms' offset, as ``fastdecode.architectures`` describes the model's type):

* the norm before attention (``input_layernorm``) -> q_proj, k_proj, v_proj: the RMSNorm's
  weight divided by s. Gemma's RMSNorm computes x_hat * (1 + w): its effective weight (1 + w)
  is divided, and w' = (1 + w) / s - 1 stored;
* the norm before the MLP (Llama's ``post_attention_layernorm``, Gemma 3's
  ``pre_feedforward_layernorm``) -> gate_proj, up_proj;
* ``v_proj`` -> o_proj: v_proj's output rows divided (attention mixes each value channel
  linearly). With grouped-query attention, value channel c of kv head j is read by the
  ``kv_repeat`` query heads that share j, so o_proj's input channels h * head_dim + i
  for those heads carry one scale: :meth:`SmoothGroup.tie_heads` makes a per-channel
  statistic so before scales are formed from it;
* ``up_proj`` -> down_proj: up_proj's output rows divided (down_proj reads
  act(gate) * up, linear in up).

:func:`fold_scales` does the arithmetic in float64 and stores the parameters' dtype:
exact in float up to that rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastdecode.architectures import layer_parts
from fastdecode.errors import ConfigError

PAIRS = ("attn_in", "attn_out", "mlp_in", "mlp_out")  # the four groups of a decoder layer, in order


@dataclass(frozen=True)
class SmoothGroup:
    """Linears that read one input, and the module that produces it."""

    kind: str  # one of PAIRS
    prev_name: str  # qualified name of the RMSNorm or Linear whose output the linears read
    prev: nn.Module
    names: tuple[str, ...]  # qualified names of the linears reading it
    linears: tuple[nn.Linear, ...]
    norm_offset: float = 0.0  # prev is an RMSNorm scaling by (norm_offset + weight): Gemma's 1
    kv_repeat: int = 1  # attn_out: query heads that share one kv head
    head_dim: int = 0  # attn_out: channels per head

    @property
    def in_features(self) -> int:
        return self.linears[0].in_features

    def tie_heads(self, values: torch.Tensor) -> torch.Tensor:
        """values: [in_features], a per-channel statistic of o_proj's input -> the same
        averaged over the query heads that share a kv head and repeated back, so scales made
        from it can be folded into v_proj. Other groups: ``values`` unchanged."""
        if self.kv_repeat == 1:
            return values
        grouped = values.view(-1, self.kv_repeat, self.head_dim)  # [kv_heads, kv_repeat, head_dim]
        return grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)


def fold_scales(group: SmoothGroup, s: torch.Tensor) -> None:
    """Fold s: [in_features] > 0 into ``group``: its linears' weight columns multiplied by s,
    its previous operation's output divided by s (the model's float function unchanged)."""
    s = s.detach().to(torch.float64)
    if s.shape != (group.in_features,) or not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
        raise ConfigError(f"smoothing scales for {group.prev_name} must be {group.in_features} positive numbers")
    with torch.no_grad():
        for linear in group.linears:
            linear.weight.copy_(linear.weight.double() * s)
        if isinstance(group.prev, nn.Linear):
            s_prev = s
            if group.kv_repeat > 1:
                grouped = s.view(-1, group.kv_repeat, group.head_dim)
                if not torch.allclose(grouped, grouped[:, :1].expand_as(grouped), rtol=1e-6):
                    raise ConfigError(f"scales for {group.names[0]} differ across the query heads of one kv head")
                s_prev = grouped[:, 0].reshape(-1)  # [kv_heads * head_dim]
            weight = group.prev.weight
            weight.copy_(weight.double() / s_prev[:, None])
            if group.prev.bias is not None:
                group.prev.bias.copy_(group.prev.bias.double() / s_prev)
        else:
            weight = group.prev.weight
            weight.copy_((group.norm_offset + weight.double()) / s - group.norm_offset)


def smoothing_groups(model: nn.Module, kinds: tuple[str, ...] = PAIRS) -> list[SmoothGroup]:
    """The groups of ``kinds`` in every decoder layer of ``model``, in layer order; where each
    layer's norms and projections lie, and the norms' weight offset, as ``fastdecode.architectures``
    describes the model's type (the Llama layout for a type it does not describe). A layer
    without the norm a group folds into, or whose projections are fused, is a ConfigError."""
    unknown = set(kinds) - set(PAIRS)
    if unknown:
        raise ConfigError(f"unknown smoothing groups {sorted(unknown)}; choose from {', '.join(PAIRS)}")
    parts, offset = layer_parts(getattr(model, "config", None))
    layers_name, layers = _decoder_layers(model, parts)
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    table = {
        "attn_in": (parts.attn_norm, parts.qkv, offset),
        "attn_out": (parts.qkv[-1], (parts.o,), 0.0),
        "mlp_in": (parts.mlp_norm, parts.gate_up, offset),
        "mlp_out": (parts.gate_up[-1], (parts.down,), 0.0),
    }
    groups = []
    for index, layer in enumerate(layers):
        prefix = f"{layers_name}.{index}."
        for kind in kinds:
            prev, readers, norm_offset = table[kind]
            repeat = heads // kv_heads if kind == "attn_out" else 1
            groups.append(
                SmoothGroup(
                    kind=kind,
                    prev_name=prefix + prev,
                    prev=layer.get_submodule(prev),
                    names=tuple(prefix + r for r in readers),
                    linears=tuple(layer.get_submodule(r) for r in readers),
                    norm_offset=norm_offset,
                    kv_repeat=repeat,
                    head_dim=head_dim if kind == "attn_out" else 0,
                )
            )
    return groups


def head_group(model: nn.Module) -> SmoothGroup | None:
    """The LM head after the final norm as a group (kind ``"head"``), or None where the model has
    no such norm (``model.norm`` an RMSNorm-like ``x * w``) or its head is no ``nn.Linear``. A head
    tied to the input embeddings stays tied: untie it (``handlers.untie_head``) before folding
    scales into it, and only then."""
    head = model.get_output_embeddings()
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if not isinstance(head, nn.Linear) or not isinstance(getattr(norm, "weight", None), nn.Parameter):
        return None
    if getattr(norm, "bias", None) is not None or norm.weight.shape != (head.in_features,):
        return None
    offset = layer_parts(model.config)[1]
    name = next(n for n, m in model.named_modules() if m is head)
    return SmoothGroup("head", "model.norm", norm, (name,), (head,), norm_offset=offset)


def _decoder_layers(model: nn.Module, parts) -> tuple[str, nn.ModuleList]:
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and _is_decoder_layer(module[0], parts):
            if not all(_is_decoder_layer(layer, parts) for layer in module):  # a hybrid: some layers of another kind
                break
            return name, module
    raise ConfigError(
        f"smoothing knows the decoder layouts whose norms precede separate q, k, v and gate, up projections; "
        f"{type(model).__name__}'s layers have none "
        f"({parts.attn_norm} -> {', '.join(parts.qkv)}; {parts.mlp_norm} -> {', '.join(parts.gate_up)})"
    )


def _is_decoder_layer(layer: nn.Module, parts) -> bool:
    if parts.attn_norm is None or parts.mlp_norm is None or len(parts.qkv) != 3 or len(parts.gate_up) != 2:
        return False  # norms after the branches only (OLMo 2), or fused projections (Phi-3)
    names = (*parts.qkv, parts.o, *parts.gate_up, parts.down, parts.attn_norm, parts.mlp_norm)
    try:
        modules = [layer.get_submodule(n) for n in names]
    except AttributeError:
        return False
    # A scale folds into a norm's weight only where the norm is x * w (RMSNorm, Gemma's 1 + w): a
    # LayerNorm's bias or a weightless norm would change the float model (StableLM, OLMo).
    foldable = all(
        isinstance(getattr(n, "weight", None), nn.Parameter)
        and n.weight.dim() == 1
        and getattr(n, "bias", None) is None
        for n in modules[7:]
    )
    return foldable and all(isinstance(p, nn.Linear) for p in modules[:7])
