"""A decoder's skeleton without transformers' modeling code, for the native decoder.

:class:`SkeletonCausalLM` has the modules a transformers causal LM of its architecture has, under the
same names and of the same shapes (``model.layers.3.self_attn.q_proj``: an ``nn.Linear`` on the meta
device, nothing allocated), built from the architecture's description (``DecoderArch.parts``) and a
:class:`~fastdecode.architectures.config_view.ConfigView`; and its rotary embedding (:class:`RotaryEmbedding`,
transformers' tables by transformers' operations). That is all the native decoder reads of a model; the
GGUF loader hangs each tensor's place in the file on it as it does on transformers' skeleton
(``gguf_model.py``), and turns it into transformers' own model where float weights are asked for.
``tests/loaders/test_skeleton.py`` compares names, shapes and RoPE tables with transformers' skeleton.
"""

from __future__ import annotations

import torch

from fastdecode.architectures import DecoderArch, head_dim_of
from fastdecode.loaders.rope import rope_inv_freq

_QKV_BIASED = ("qwen2", "qwen2_moe")  # transformers gives their q, k, v projections a bias whatever the config says
_HALF_ROPE = ("gpt_oss",)  # transformers' rotary module of these gives each frequency once: cos, sin [.., D / 2]


class Weights(torch.nn.Module):
    """A module that only holds parameters (a norm's weight, a router's, the 3-D experts tensors), on meta."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))


def _linear(n_in: int, n_out: int, bias: bool = False) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out, bias=bias, device="meta").requires_grad_(False)


def _put_param(root: torch.nn.Module, path: str, shape: tuple[int, ...]) -> None:
    """A parameter of ``shape`` on meta at dotted ``path`` (its module already there: gpt-oss's ``self_attn.sinks``)."""
    owner, _, name = path.rpartition(".")
    param = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
    root.get_submodule(owner).register_parameter(name, param)


def _put(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """``module`` at dotted ``path`` below ``root``, plain containers made on the way."""
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    root.add_module(name, module)


def _attention(layer: torch.nn.Module, config, arch: DecoderArch) -> None:
    parts, hidden, d = arch.parts, config.hidden_size, head_dim_of(config)
    h = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or h
    bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = bias or config.model_type in _QKV_BIASED
    widths = (h * d, kv * d, kv * d) if len(parts.qkv) == 3 else ((h + 2 * kv) * d,)
    for path, width in zip(parts.qkv, widths, strict=True):
        _put(layer, path, _linear(hidden, width, qkv_bias))
    _put(layer, parts.o, _linear(h * d, hidden, bias))
    if parts.q_norm is not None:
        per_head = arch.qk_norm != "proj"
        _put(layer, parts.q_norm, Weights(weight=(d if per_head else h * d,)))
        _put(layer, parts.k_norm, Weights(weight=(d if per_head else kv * d,)))
    if parts.sinks is not None:
        _put_param(layer, parts.sinks, (h,))


def _gated(layer: torch.nn.Module, gate_up: tuple[str, ...], down: str, hidden: int, inter: int, bias: bool) -> None:
    for path in gate_up:
        _put(layer, path, _linear(hidden, inter * (2 if len(gate_up) == 1 else 1), bias))
    _put(layer, down, _linear(inter, hidden, bias))


def _ffn(layer: torch.nn.Module, index: int, config, arch: DecoderArch) -> None:
    parts, hidden = arch.parts, config.hidden_size
    if arch.ffn_kind(index) == "gated":
        _gated(layer, parts.gate_up, parts.down, hidden, config.intermediate_size, getattr(config, "mlp_bias", False))
        return
    n, inter = arch.experts.n_experts, getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    if parts.experts_layout == "interleaved":  # gpt-oss's: a biased router; [E, hidden, 2 I] and [E, I, hidden], biased
        _put(layer, parts.router, _linear(hidden, n, True))
        shapes = dict(gate_up_proj=(n, hidden, 2 * inter), gate_up_proj_bias=(n, 2 * inter))
        _put(layer, parts.experts, Weights(**shapes, down_proj=(n, inter, hidden), down_proj_bias=(n, hidden)))
    else:
        _put(layer, parts.router, _linear(hidden, n))
        _put(layer, parts.experts, Weights(gate_up_proj=(n, 2 * inter, hidden), down_proj=(n, hidden, inter)))
    if arch.experts.shared_expert:
        _gated(layer, parts.shared_gate_up, parts.shared_down, hidden, config.shared_expert_intermediate_size, False)
        _put(layer, parts.shared_gate, _linear(hidden, 1))


def _layer(index: int, config, arch: DecoderArch) -> torch.nn.Module:
    layer = torch.nn.Module()
    parts = arch.parts
    _attention(layer, config, arch)
    _ffn(layer, index, config, arch)
    for path in (parts.attn_norm, parts.post_attn_norm, parts.mlp_norm, parts.post_mlp_norm):
        if path is not None:
            _put(layer, path, Weights(weight=(config.hidden_size,)))
    return layer


class RotaryEmbedding(torch.nn.Module):
    """cos and sin [batch, positions, head_dim] as transformers' rotary module of this config gives them:
    its inverse frequencies (``loaders/rope.py``: ``modeling_rope_utils``' function of the RoPE type, the
    same operations) and its operations; per layer type where the config's table is (Gemma 3: ``forward(x, positions,
    "sliding_attention")``); each frequency once where transformers' module gives it so (gpt-oss)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.half = config.model_type in _HALF_ROPE
        rope = config.rope_parameters
        layer_types = sorted(set(getattr(config, "layer_types", None) or ()))
        self.per_type = bool(layer_types) and all(t in rope for t in layer_types)
        if not self.per_type:
            self.rope_type = rope["rope_type"]
            inv_freq, self.attention_scaling = rope_inv_freq(config, rope)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            return
        self.rope_type = {}
        for layer_type in layer_types:  # transformers' names: sliding_attention_inv_freq, ...
            self.rope_type[layer_type] = rope[layer_type]["rope_type"]
            inv_freq, scaling = rope_inv_freq(config, rope[layer_type], layer_type)
            self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)
            setattr(self, f"{layer_type}_attention_scaling", scaling)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        prefix = f"{layer_type}_" if self.per_type else ""
        inv_freq, scaling = getattr(self, f"{prefix}inv_freq"), getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = freqs if self.half else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


class SkeletonCausalLM(torch.nn.Module):
    """A causal LM's modules by transformers' names, weights on meta (see the module's docstring). Called as
    a model it has no forward: the loader's hook says what to do instead."""

    def __init__(self, config, arch: DecoderArch) -> None:
        super().__init__()
        self.config = config
        hidden, vocab = config.hidden_size, config.vocab_size
        self.model = torch.nn.Module()
        self.model.embed_tokens = Weights(weight=(vocab, hidden))
        self.model.layers = torch.nn.ModuleList(_layer(i, config, arch) for i in range(config.num_hidden_layers))
        self.model.norm = Weights(weight=(hidden,))
        self.model.rotary_emb = RotaryEmbedding(config)
        self.lm_head = _linear(hidden, vocab)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def generate(self, *args, **kwargs):
        """transformers' ``generate`` runs transformers' model: called here, the loader's hook says how to get it."""
        return self(*args, **kwargs)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head
