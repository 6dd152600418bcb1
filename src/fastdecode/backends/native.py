"""A lean decoder for the Llama family and Gemma 3 with a static, position-indexed KV cache.

Why it exists (measured on the 2-core CPU this project is built on): the
transformers path pays per-op framework overhead and a dynamic cache that is
concatenated on every step; here each layer is a handful of tensor ops over
preallocated buffers. Rolling back rejected draft tokens costs nothing: the
position simply does not advance and the next write overwrites them (the
gpt-fast design).

Supported: Llama, Mistral (without a sliding window shorter than the
context), Qwen2 - every model whose decoder layer is RMSNorm -> GQA attention
with RoPE -> RMSNorm -> SwiGLU MLP - and Gemma 3 (text), the same layer with
the additions ``fastdecode.backends.arch`` describes. Anything else stays on
the transformers path (``backend="auto"`` falls back; ``backend="native"``
refuses clearly).

Weights are taken from the loaded model, not copied: the fused QKV and
gate/up matrices are built once and the model's own parameters are re-pointed
at views of them, so both paths share one copy. Linear layers are callables
from ``fastdecode.backends.linear`` so the same decoder runs in float and in
low-bit weights.

Two layer paths: in float32 on an x86-64 CPU with AVX2, fastdecode's kernels
(``fastdecode.kernels.cpu``: the row-invariant GEMM and attention and the fused
norms, RoPE and SwiGLU; a decode or verification pass runs each layer as one
call); elsewhere torch ops (any dtype or device, and ``float_kernel="torch"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fastdecode.backends.arch import NATIVE_MODEL_TYPES, decoder_arch, head_dim_of, native_support  # noqa: F401 (re-exported)
from fastdecode.backends.base import Target
from fastdecode.backends.hf import context_length_of
from fastdecode.backends.linear import RowInvariantInt8Linear, RowInvariantLinear
from fastdecode.kernels.cpu import DecoderLayerKernel, attention_rows, glu, head_rms_norm_, rms_norm, rope_qkv
from fastdecode.errors import ConfigError

Linear = Callable[[torch.Tensor], torch.Tensor]


class _Concat:
    """Unfused projections (already low-bit modules) called side by side."""

    def __init__(self, parts) -> None:
        self.parts = list(parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.parts], dim=-1)


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden], the offset of DecoderArch.norm_offset added (as every norm weight here)
    qkv: Linear  # hidden -> (n_heads + 2 * n_kv_heads) * head_dim
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear
    q_norm: torch.Tensor | None = None  # [head_dim] (DecoderArch.qk_norm)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [hidden] (DecoderArch.sandwich_norms)
    post_mlp_norm: torch.Tensor | None = None
    window: int | None = None  # sliding window in positions; None: the whole context
    rope: str | None = None  # the key of its RoPE table


def _fuse(modules: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``modules`` along the output dim and
    re-point each module's parameters at views of the result: one copy, shared.
    A second native target over the same model finds them fused already."""
    return _fused([m.weight for m in modules]), _fused_bias(modules)


def _fused_bias(modules: Sequence[torch.nn.Linear]) -> torch.Tensor | None:
    has_bias = [m.bias is not None for m in modules]
    if not any(has_bias):
        return None
    if not all(has_bias):
        raise ConfigError("mixed biased and unbiased projections are not supported natively")
    return _fused([m.bias for m in modules])


def _fused(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    first = params[0].detach()
    rows = sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    step = first[0].numel() * first.element_size()
    ptr = first.data_ptr()
    already = True
    for p in params:
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or p.data_ptr() != ptr or not p.is_contiguous():
            already = False
            break
        ptr += p.shape[0] * step
    if already:
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


class NativeTarget(Target):
    name = "native"

    def __init__(self, model, weights: str = "float", layers: Sequence[int] | None = None,
                 float_kernel: str = "auto") -> None:
        """``layers``: indices of the decoder layers to run (all by default); a
        subset makes the early-exit / layer-skip self-drafter of Draft & Verify,
        sharing the model's weights and keeping a cache of its own.
        ``float_kernel``: how ``weights="float"`` layers multiply
        (``fastdecode.backends.linear.make_float_linear``)."""
        from fastdecode.backends.linear import make_linear

        arch = decoder_arch(model)
        if isinstance(arch, str):
            raise ConfigError(f"--backend native cannot run this model: {arch}; use --backend hf or auto")
        self.arch = arch
        config = model.config
        self.model = model
        self.weights = weights
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.context_length = context_length_of(config)
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = head_dim_of(config)
        self.eps = config.rms_norm_eps
        self.intermediate_size = config.intermediate_size
        self.scale = arch.attn_scale
        inner = model.model
        self.embed = inner.embed_tokens.weight  # [vocab, hidden]
        # Gemma scales embeddings by sqrt(hidden), as its module does: the float32 scalar cast to the weights' dtype.
        scale = getattr(inner.embed_tokens, "embed_scale", arch.embed_scale)
        self.embed_scale = None if arch.embed_scale is None else torch.as_tensor(scale).to(self.dtype)
        self.final_norm = self._norm_weight(inner.norm.weight)
        n_layers = len(inner.layers)
        self.layer_indices = list(range(n_layers)) if layers is None else sorted(set(layers))
        if not self.layer_indices or not all(0 <= i < n_layers for i in self.layer_indices):
            raise ConfigError(f"layer indices must be a non-empty subset of 0..{n_layers - 1}, got {layers!r}")

        def linear(modules):
            # A module that is already low-bit (fastdecode.quant, e.g. GPTQ) is
            # used as it is; plain nn.Linear projections are fused first.
            if all(type(m) is torch.nn.Linear for m in modules):
                w, b = _fuse(modules) if len(modules) > 1 else (modules[0].weight, modules[0].bias)
                return make_linear(w, b, weights, float_kernel)
            if len(modules) == 1:
                return modules[0]
            return _Concat(modules)

        norm = self._norm_weight
        self.layers: list[_Layer] = []
        for i in self.layer_indices:
            layer = inner.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            # Gemma: input -> post_attention (on the attention output) -> pre_feedforward -> post_feedforward;
            # Llama: input -> post_attention (before the MLP).
            sandwich = arch.sandwich_norms
            self.layers.append(
                _Layer(
                    attn_norm=norm(layer.input_layernorm.weight),
                    qkv=linear([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o=linear([attn.o_proj]),
                    mlp_norm=norm((layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).weight),
                    gate_up=linear([mlp.gate_proj, mlp.up_proj]),
                    down=linear([mlp.down_proj]),
                    q_norm=norm(attn.q_norm.weight) if arch.qk_norm else None,
                    k_norm=norm(attn.k_norm.weight) if arch.qk_norm else None,
                    post_attn_norm=norm(layer.post_attention_layernorm.weight) if sandwich else None,
                    post_mlp_norm=norm(layer.post_feedforward_layernorm.weight) if sandwich else None,
                    window=arch.windows[i] if arch.windows else None,
                    rope=arch.layer_types[i] if arch.layer_types else None,
                )
            )
        head = model.get_output_embeddings()
        self.lm_head = linear([head])
        # The kernel family the float / int8 layers actually run ("rowgemm" / "torch"); None for int4.
        self.float_kernel = getattr(self.lm_head, "kernel", "torch") if weights in ("float", "int8") else None
        # fastdecode's fused float32 CPU kernels (norms, RoPE, SwiGLU, and the
        # row-invariant attention of decode and verification passes) where they
        # run; torch ops otherwise (other dtypes and devices, float_kernel="torch").
        self.cpu_kernels = self._cpu_kernels_fit(float_kernel)
        # Decode and verification passes run each layer as one kernel call when every
        # projection is on a row-invariant GEMM (float32 or int8): same bits, fewer calls.
        self._layer_calls = None
        projections = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in self.layers]
        kernel_types = {type(f) for fs in projections for f in fs}
        if self.cpu_kernels and len(kernel_types) == 1 and kernel_types <= {RowInvariantLinear, RowInvariantInt8Linear}:
            def proj(f):  # (weight, scales, bias) as the layer kernel takes them
                return (f.qweight, f.scales, f.bias) if isinstance(f, RowInvariantInt8Linear) else (f.weight, None, f.bias)

            self._layer_calls = [
                DecoderLayerKernel(layer.attn_norm.detach(), proj(layer.qkv), proj(layer.o), layer.mlp_norm.detach(),
                                   proj(layer.gate_up), proj(layer.down), self.n_heads, self.n_kv_heads, self.head_dim,
                                   self.eps, layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_mlp_norm,
                                   arch.activation, layer.window)
                for layer in self.layers
            ]
        # Why "auto" fell back to torch for a float32 CPU model (slower, not wrong): the CLI and demo say so.
        self.kernel_note: str | None = None
        if float_kernel == "auto" and self.dtype == torch.float32 and self.device.type == "cpu" and not self.cpu_kernels:
            from fastdecode.kernels.cpu import rowgemm_unavailable

            reason = rowgemm_unavailable()
            self.kernel_note = reason and f"running torch's float32 kernels ({reason})"
        self.vocab_size = head.out_features
        self._rotary = inner.rotary_emb
        self._rope_tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (cos, sin) [capacity, head_dim]
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._capacity = 0
        self._pos = 0
        self._row_group: tuple[int, int] | None = None
        self.row_group  # probe now, not inside the first decode step's timing

    def _cpu_kernels_fit(self, float_kernel: str) -> bool:
        from fastdecode.kernels.cpu import MAX_HEAD_DIM, rowgemm_unavailable

        return (float_kernel != "torch" and self.dtype == torch.float32 and self.device.type == "cpu"
                and self.head_dim % 8 == 0 and self.head_dim <= MAX_HEAD_DIM and rowgemm_unavailable() is None)

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's effective weight: the model's own tensor, or Gemma's 1 + w, made
        once in float32 as Gemma3RMSNorm makes it on every call (small: [hidden] or [head_dim])."""
        if not self.arch.norm_offset:
            return weight.detach()
        return self.arch.norm_offset + weight.detach().float()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step streams: every linear layer once (the
        tied LM head included) plus the norms; the embedding lookup reads one row."""
        from fastdecode.backends.linear import linear_weight_bytes

        total = linear_weight_bytes(self.lm_head) + self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            total += sum(linear_weight_bytes(x) for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
            norms = (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.post_attn_norm, layer.post_mlp_norm)
            total += sum(t.numel() * t.element_size() for t in norms if t is not None)
        return total

    # -- cache -------------------------------------------------------------
    def reset(self) -> None:
        self._pos = 0

    @property
    def cache_len(self) -> int:
        return self._pos

    def truncate(self, length: int) -> None:
        # Rejected positions are simply overwritten by the next forward.
        self._pos = min(self._pos, length)

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = min(max(needed, 2 * self._capacity, 256), self.context_length + self.ROWS_PROBED)
        shape = (self.n_kv_heads, capacity, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        for old, new in zip(self._k + self._v, new_k + new_v):
            new[:, : self._pos] = old[:, : self._pos]
        self._k, self._v, self._capacity = new_k, new_v, capacity
        # RoPE tables from the model's own rotary module, so scaling variants match;
        # Gemma 3's takes the layer type (local and global layers have their own base).
        positions = torch.arange(capacity, device=self.device)[None]
        probe = torch.empty(1, dtype=self.dtype, device=self.device)
        for key in {layer.rope for layer in self.layers}:
            cos, sin = self._rotary(probe, positions) if key is None else self._rotary(probe, positions, key)
            self._rope_tables[key] = (cos[0], sin[0])

    # -- forward -----------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers' LlamaRMSNorm / Gemma3RMSNorm.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.arch.norm_offset:  # Gemma: (h * (1 + w)) in float32, then the cast
            return (h * weight).to(x.dtype)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    # Row invariance. A verification pass must give each row exactly the logits
    # a one-token decode step would: speculative output equal to plain output
    # then holds by construction, not by luck. Measured on the CPUs we run:
    # fastdecode's GEMM (``kernels/cpu.c``, the default for float32 and int8
    # weights) gives row i the same bits whatever the number of rows M, by
    # construction; so did torch's int8/int4 packed kernels and bf16 F.linear on
    # a Sapphire Rapids; fp32 F.linear (MKL) does only within row-count groups
    # (there {1}, {2, 3}, {4..15}); SDPA does not (a 1-query call and an
    # 8-query masked call differ by ~2e-7 in fp32, ~1e-3 in bf16, and a cast to
    # bf16 inside a low-bit linear turns such noise into flipped tokens). So
    # decode and verification passes run attention one query row at a time, with
    # the call a decode step makes, and every such pass is cut into chunks whose
    # row counts lie in one invariant group [rows_min, rows_max], padded with
    # throw-away rows up to rows_min. The group is found by probing this model's
    # own linear layers once (``_probe_row_invariance``).
    ROWS_PROBED = RowInvariantLinear.MAX_ROWS  # beyond it the float32 layers switch kernel (prefill)

    def _probe_row_invariance(self) -> tuple[int, int]:
        first = self.layers[0]
        hidden = self.embed.shape[1]
        layers = [(first.qkv, hidden), (first.o, self.n_heads * self.head_dim), (first.gate_up, hidden),
                  (first.down, self.intermediate_size), (self.lm_head, hidden)]
        gen = torch.Generator(device="cpu").manual_seed(0)
        rows = []
        for layer, in_features in layers:
            x = torch.randn(self.ROWS_PROBED, in_features, generator=gen).to(device=self.device, dtype=self.dtype)
            rows.append({m: layer(x[:m])[0] for m in range(1, self.ROWS_PROBED + 1)})

        def group_end(a: int) -> int:
            b = a
            while b < self.ROWS_PROBED and all(torch.equal(r[b + 1], r[a]) for r in rows):
                b += 1
            return b

        for a in range(1, self.ROWS_PROBED + 1):
            b = group_end(a)
            if b >= min(a + 1, self.ROWS_PROBED):  # room for at least one draft token
                return a, b
        return 1, 1

    @property
    def row_group(self) -> tuple[int, int]:
        if self._row_group is None:
            self._row_group = self._probe_row_invariance()
        return self._row_group

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        """``num_logits == len(token_ids)``: a decode or verification pass (row-invariant,
        see above); ``num_logits < len(token_ids)``: a prefill."""
        n = len(token_ids)
        if num_logits < n:
            return self._forward(token_ids, num_logits, rowwise=False)
        rows_min, rows_max = self.row_group
        out = []
        for i in range(0, n, rows_max):
            chunk = list(token_ids[i : i + rows_max])
            real = len(chunk)
            # Throw-away rows after the real ones: causal attention keeps them out
            # of the real rows, and the position advances by the real rows only.
            chunk += [chunk[-1]] * (rows_min - real)
            out.append(self._forward(chunk, len(chunk), rowwise=True)[:real])
            self._pos -= len(chunk) - real
        return torch.cat(out)

    def _forward(self, token_ids: Sequence[int], num_logits: int, rowwise: bool) -> torch.Tensor:
        n = len(token_ids)
        start = self._pos
        end = start + n
        if end > self.context_length + self.ROWS_PROBED:  # padding rows may run past the context
            raise ConfigError(f"sequence of {end} tokens exceeds the context length {self.context_length}")
        self._ensure_capacity(end)
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        x = self.embed[ids]  # [n, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {key: (cos[start:end], sin[start:end]) for key, (cos, sin) in self._rope_tables.items()}  # [n, head_dim]
        # Query i sits at position start + i and sees keys 0 .. start + i (the last W of them with a window W).
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in {layer.window for layer in self.layers}:
            masks[window] = None
            if n > 1 and not rowwise:
                mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
                if window is not None:
                    mask &= torch.ones(n, end, dtype=torch.bool, device=self.device).triu(diagonal=start - window + 1)
                masks[window] = mask
        if rowwise and self._layer_calls is not None and n <= RowInvariantLinear.MAX_ROWS:
            for layer_call, layer, k_cache, v_cache in zip(self._layer_calls, self.layers, self._k, self._v):
                cos, sin = rope[layer.rope]
                layer_call(x, cos, sin, k_cache, v_cache, start, self.scale)  # x updated in place
        else:
            layer_forward = self._layer_kernels if self.cpu_kernels else self._layer_torch
            for layer, k_cache, v_cache in zip(self.layers, self._k, self._v):
                cos, sin = rope[layer.rope]
                x = layer_forward(layer, x, k_cache, v_cache, start, cos, sin, masks[layer.window], rowwise)
        self._pos = end
        x = self._norm(x[n - num_logits :], self.final_norm)
        return self.lm_head(x).float()  # [num_logits, vocab]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps) if self.cpu_kernels else self._rms_norm(x, weight)

    def _layer_kernels(self, layer: _Layer, x, k_cache, v_cache, start, cos, sin, mask, rowwise) -> torch.Tensor:
        """One decoder layer on fastdecode's fused float32 CPU kernels. x: [n, hidden]."""
        n, H, KV, D = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = layer.qkv(rms_norm(x, layer.attn_norm, self.eps))  # [n, (H + 2 KV) D]
        if layer.q_norm is not None:
            head_rms_norm_(head_rms_norm_(qkv, 0, H, D, layer.q_norm, self.eps), H, KV, D, layer.k_norm, self.eps)
        q = rope_qkv(qkv, H, KV, D, cos, sin, k_cache, v_cache, start)  # [n, H, D]
        if rowwise:
            out = attention_rows(q, k_cache, v_cache, start, self.scale, layer.window)  # [n, H * D]
        else:  # a prefill: one masked SDPA call
            end = start + n
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k_cache[None, :, :end], v_cache[None, :, :end],
                attn_mask=mask, scale=self.scale, enable_gqa=H != KV,
            )[0].transpose(0, 1).reshape(n, H * D)
        h = layer.o(out)
        x = x + (h if layer.post_attn_norm is None else rms_norm(h, layer.post_attn_norm, self.eps))
        h = layer.down(glu(layer.gate_up(rms_norm(x, layer.mlp_norm, self.eps)), self.arch.activation))
        return x + (h if layer.post_mlp_norm is None else rms_norm(h, layer.post_mlp_norm, self.eps))

    def _layer_torch(self, layer: _Layer, x, k_cache, v_cache, start, cos, sin, mask, rowwise) -> torch.Tensor:
        """One decoder layer in torch ops (any dtype and device). x: [n, hidden]."""
        n, H, KV, D = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        end = start + n
        h = self._rms_norm(x, layer.attn_norm)
        qkv = layer.qkv(h)  # [n, (H + 2 KV) D]
        q = qkv[:, : H * D].view(n, H, D).transpose(0, 1)  # [H, n, D]
        k = qkv[:, H * D : (H + KV) * D].view(n, KV, D).transpose(0, 1)  # [KV, n, D]
        v = qkv[:, (H + KV) * D :].view(n, KV, D).transpose(0, 1)
        if layer.q_norm is not None:
            q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
        q = self._rope(q, cos, sin)
        k_cache[:, start:end] = self._rope(k, cos, sin)
        v_cache[:, start:end] = v
        if rowwise:
            lo = [0 if layer.window is None else max(0, start + i + 1 - layer.window) for i in range(n)]
            attn = torch.cat([
                F.scaled_dot_product_attention(
                    q[None, :, i : i + 1], k_cache[None, :, lo[i] : start + i + 1], v_cache[None, :, lo[i] : start + i + 1],
                    scale=self.scale, enable_gqa=H != KV,
                )
                for i in range(n)
            ], dim=2)  # [1, H, n, D]
        else:
            attn = F.scaled_dot_product_attention(
                q[None], k_cache[None, :, :end], v_cache[None, :, :end],
                attn_mask=mask, scale=self.scale, enable_gqa=H != KV,
            )  # [1, H, n, D]
        h = layer.o(attn[0].transpose(0, 1).reshape(n, H * D))
        x = x + (h if layer.post_attn_norm is None else self._rms_norm(h, layer.post_attn_norm))
        gate, up = layer.gate_up(self._rms_norm(x, layer.mlp_norm)).chunk(2, dim=-1)
        act = F.silu(gate) if self.arch.activation == "silu" else F.gelu(gate, approximate="tanh")
        h = layer.down(act * up)
        return x + (h if layer.post_mlp_norm is None else self._rms_norm(h, layer.post_mlp_norm))
