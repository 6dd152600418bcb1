"""A lean decoder for the architectures ``fastdecode.architectures`` describes, over a paged, position-indexed KV cache.

Why it exists (measured on the 2-core CPU this project is built on): the
transformers path pays per-op framework overhead and a dynamic cache that is
concatenated on every step; here each layer is a handful of tensor ops over
preallocated buffers. Rolling back rejected draft tokens costs nothing: the
position simply does not advance and the next write overwrites them (the
gpt-fast design). ``NativeTarget`` is an ``Executor``: shared by every request,
it holds no sequence's state; the cache is the caller's (the engine's, or a
``PagedSequence``'s).

Supported: the registry of ``fastdecode.architectures`` (Llama, Mistral, Qwen2,
Qwen3, OLMo 2, Granite, SmolLM3, Phi-3, Gemma 2, Gemma 3 text; the mixtures of
experts Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, gpt-oss): one decoder layer
(``backends/layer.py``) that reads each architecture's description. Anything else
stays on the transformers path (``backend="auto"`` falls back; ``backend="native"``
refuses clearly).

Weights are taken from the loaded model, not copied: the fused QKV and
gate/up matrices are built once and the model's own parameters are re-pointed
at views of them, so both paths share one copy. Linear layers are callables
built by ``fastdecode.backends.native_weights`` so the same decoder runs in float
and in low-bit weights.

Two layer paths: in float32 on an x86-64 CPU with AVX2, fastdecode's kernels
(``fastdecode.kernels.cpu``: the row-invariant GEMM and attention and the fused
norms, RoPE and SwiGLU; a decode or verification pass runs each layer as one
call); elsewhere torch ops (any dtype or device, and ``float_kernel="torch"``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastdecode.architectures import (  # noqa: F401 (re-exported)
    HF_BACKEND_NOTE,
    NATIVE_MODEL_TYPES,
    NOPE,
    DecoderArch,
    Unsupported,
    context_length_of,
    decoder_arch,
    head_dim_of,
    native_support,
)
from fastdecode.backends.base import BatchEntry, Executor, ExpertsProfile
from fastdecode.backends.ffn import ExpertsMLP, take_experts_run
from fastdecode.backends.layer import KernelOps, TorchOps, build_layer, ffn_branch, forward, layer_kernel
from fastdecode.backends.linear import linear_weight_bytes, probe_row_group
from fastdecode.backends.native_weights import Linear, NativeLinears
from fastdecode.errors import ConfigError
from fastdecode.kernels.cpu import MAX_HEAD_DIM, LayerStack, PagedRows, rowgemm_unavailable
from fastdecode.kernels.kv_formats import (
    KV_CACHE_DTYPES,  # noqa: F401 (re-exported)
    KVFormat,
    kv_cache_dtype_name,
    parse_kv_cache_dtype,
    pool_format,
)
from fastdecode.kv.attention import AttentionObserver, check_rope_shift, rotate_keys
from fastdecode.kv.cache import BlockPool, PagedKVCache
from fastdecode.loaders.gguf_model import ATTR as GGUF_ATTR
from fastdecode.loaders.gguf_model import RowEmbedding, model_device, model_dtype


def _kv_formats(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> tuple[KVFormat, KVFormat]:
    try:
        formats = parse_kv_cache_dtype(kv_cache_dtype, model_dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for fmt in formats:
        if fmt.fits(head_dim) is not None:
            raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: {fmt.fits(head_dim)}")
    return formats


def _layer_indices(n_layers: int, layers: Sequence[int] | None) -> list[int]:
    indices = list(range(n_layers)) if layers is None else sorted(set(layers))
    if not indices or not all(0 <= i < n_layers for i in indices):
        raise ConfigError(f"layer indices must be a non-empty subset of 0..{n_layers - 1}, got {layers!r}")
    return indices


class NativeTarget(Executor):
    """The native decoder as an executor: weights, kernels and RoPE tables, shared by every
    sequence; no sequence's state (one sequence on it: ``backends.base.PagedSequence``)."""

    name = "native"

    def __init__(
        self,
        model,
        weights: str = "float",
        layers: Sequence[int] | None = None,
        float_kernel: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_calibration: Sequence[int] | None = None,
    ) -> None:
        """``layers``: indices of the decoder layers to run (all by default); a
        subset makes the early-exit / layer-skip self-drafter of Draft & Verify,
        sharing the model's weights. ``float_kernel``: how ``weights="float"`` layers
        multiply (``fastdecode.backends.linear.make_float_linear``). ``kv_cache_dtype``: what
        the KV cache holds (:data:`KV_CACHE_DTYPES`; ``auto``: the model's dtype; ``K/V``: keys
        and values apart). float16 halves the cache (llama.cpp's default), q8_0 and q4_0 (blocks
        of 32 with an fp16 scale, ``kernels/kv.c``) take 0.27 and 0.14 of float32's bytes; a key
        or value is rounded once, when written, so the numeric model changes but every pass
        reads the same values: speculative decoding stays lossless against it. ``kv_calibration``:
        token ids (``fastdecode.kv.calibration.calibration_ids``) to calibrate a rotated key format's affine on
        (``kv/calibration.py``), once, here; None: keys stored as they are."""
        arch = decoder_arch(model)
        if isinstance(arch, str):
            raise ConfigError(f"--backend native cannot run this model: {arch}; {HF_BACKEND_NOTE}")
        self.arch, self.model = arch, model
        self.device, self.dtype = model_device(model), model_dtype(model)
        self._read_config(model.config, arch)
        self.kv_formats = _kv_formats(kv_cache_dtype, self.dtype, self.head_dim)  # (keys', values')
        self.kv_cache_dtype = kv_cache_dtype_name(*self.kv_formats)
        inner = model.model
        lazy = getattr(inner.embed_tokens, GGUF_ATTR, None)  # a GGUF skeleton's table stays in the file
        self.embed = inner.embed_tokens.weight if lazy is None else RowEmbedding(lazy)  # [vocab, hidden]
        # Gemma scales embeddings by sqrt(hidden), as its module does: the float32 scalar cast to the weights' dtype.
        scale = getattr(inner.embed_tokens, "embed_scale", arch.embed_scale)
        self.embed_scale = None if arch.embed_scale is None else torch.as_tensor(scale).to(self.dtype)
        self.final_norm = self._norm_weight(inner.norm.weight)
        self.layer_indices = _layer_indices(len(inner.layers), layers)

        linears = NativeLinears(model, weights, float_kernel)
        shape = (self.n_heads, self.n_kv_heads, self.head_dim, self.eps)
        try:
            self.layers = [
                build_layer(inner.layers[i], i, arch, linears, self._norm_weight, shape) for i in self.layer_indices
            ]
        except Unsupported as exc:  # a part the description names is not as it says (an experts tensor's shape)
            raise ConfigError(f"--backend native cannot run this model: {exc}; {HF_BACKEND_NOTE}") from None
        head = model.get_output_embeddings()
        self.lm_head = linears([head])
        self.weights = linears.weights  # the numeric model: the formats taken, saved low-bit layers included
        self.vocab_size = head.out_features
        # The kernel family the layers actually run ("rowgemm" / "qdot" / "torch"); None for int4.
        self.float_kernel = getattr(self.lm_head, "kernel", "torch") if weights != "int4" else None

        # fastdecode's fused float32 CPU kernels (norms, RoPE, SwiGLU, and the
        # row-invariant attention of decode and verification passes) where they
        # run; torch ops otherwise (other dtypes and devices, float_kernel="torch").
        self.cpu_kernels = self._cpu_kernels_fit(float_kernel)
        if self.cpu_kernels and any(f.code is None for f in self.kv_formats):
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype}: fastdecode's CPU kernels keep the KV cache in "
                "float32 or float16, or quantized: q8_0, q4_0"
            )
        self._layer_calls = self._layer_stack() if self.cpu_kernels else None
        self._ops = (
            KernelOps(self._lin, self.eps) if self.cpu_kernels else TorchOps(self._lin, self.eps, arch.norm_in_float32)
        )
        notes = (linears.note or self._fallback_note(float_kernel), self._context_note(model.config))
        self.kernel_note = "; ".join(n for n in notes if n) or None

        self._rotary = inner.rotary_emb
        # key -> (cos, sin) [length, head_dim]; shared by every sequence (they only ever grow it), so
        # its length is read from the tables themselves, never kept apart from them
        self._rope_tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        # Probed now, not inside the first decode step's timing (see "forward over ragged rows").
        self.row_group: tuple[int, int] = self._probe_row_invariance()
        self._key_affine: list[torch.Tensor] | None = None  # per layer: what this target's caches store keys with
        if kv_calibration and self.kv_formats[0].rotated:  # at build, not inside the first request's time
            from fastdecode.kv.calibration import calibrate_key_affine

            self._key_affine = calibrate_key_affine(self, kv_calibration)

    def _read_config(self, config, arch: DecoderArch) -> None:
        self.context_length = min(context_length_of(config), arch.context_limit or context_length_of(config))
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = head_dim_of(config)
        self.eps = config.rms_norm_eps
        self.intermediate_size = config.intermediate_size
        self.scale = arch.attn_scale

    def _layer_stack(self) -> list[tuple[int, int, LayerStack | None]] | None:
        """Decode and verification passes run each layer as one kernel call when every projection is on a
        row-invariant C GEMM (float32, int8, block formats): same bits, fewer calls. Per run of layers
        [start, stop): its LayerStack, or None for layers that have no C form, which run through the
        per-op kernels (KernelOps, the same bits); None: no layer has a C form. An experts layer's C form
        is its attention half, which ends its run (its FFN runs in Python after the call)."""
        kernels = [layer_kernel(layer) for layer in self.layers]
        if all(k is None for k in kernels):
            return None
        runs, start = [], 0
        for i in range(1, len(kernels) + 1):
            ends = kernels[i - 1] is not None and kernels[i - 1].ffn_kind == "none"
            if i == len(kernels) or ends or (kernels[i] is None) != (kernels[start] is None):
                runs.append((start, i, None if kernels[start] is None else LayerStack(kernels[start:i])))
                start = i
        return runs

    def _run_layer_stack(self, x: torch.Tensor, rope: dict, cache: PagedKVCache, rows: PagedRows) -> torch.Tensor:
        """Every layer over x [n, hidden], a run of layers at a time (``_layer_stack``)."""
        affines = cache.k_affine or [None] * len(self.layers)
        for start, stop, stack in self._layer_calls:
            layers = self.layers[start:stop]
            if stack is None:
                for layer, k, v, a in zip(layers, cache.k[start:stop], cache.v[start:stop], affines[start:stop]):
                    x = forward(layer, self._ops, x, k, v, rows, *rope[layer.rope], self.scale, None, a)
                continue
            x = x.contiguous()  # updated in place by the layer stack
            h = stack(
                x,
                [rope[layer.rope] for layer in layers],
                cache.k[start:stop],
                cache.v[start:stop],
                rows,
                self.scale,
                k_affines=None if cache.k_affine is None else cache.k_affine[start:stop],
            )
            if h is not None:  # the last layer's attention half ran in C: its FFN (experts) here
                x = ffn_branch(self.layers[stop - 1], self._ops, x, h)
        return x

    def _context_note(self, config) -> str | None:
        """Why the context is shorter than the model's (LongRoPE's short factors serve only so far)."""
        full = context_length_of(config)
        if self.context_length >= full:
            return None
        return (
            f"the native decoder runs {self.context_length} of this model's {full} positions "
            f"(its RoPE's original length); {HF_BACKEND_NOTE} for more"
        )

    def _fallback_note(self, float_kernel: str) -> str | None:
        """Why "auto" fell back to torch for a float32 CPU model (slower, not wrong): the CLI and demo say so."""
        if (
            float_kernel == "auto"
            and self.dtype == torch.float32
            and self.device.type == "cpu"
            and not self.cpu_kernels
        ):
            reason = rowgemm_unavailable()
            return reason and f"running torch's float32 kernels ({reason})"
        return None

    def _cpu_kernels_fit(self, float_kernel: str) -> bool:
        return (
            float_kernel != "torch"
            and self.dtype == torch.float32
            and self.device.type == "cpu"
            and self.head_dim % 8 == 0
            and self.head_dim <= MAX_HEAD_DIM
            and rowgemm_unavailable() is None
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's effective weight: the model's own tensor, or Gemma's 1 + w, made
        once in float32 as Gemma3RMSNorm makes it on every call (small: [hidden] or [head_dim])."""
        if not self.arch.norm_offset:
            return weight.detach()
        return self.arch.norm_offset + weight.detach().float()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step streams: every linear layer once (the
        tied LM head included) plus the norms; the embedding lookup reads one row. A mixture of
        experts counts every expert (the model's size; one row's step reads top_k of them)."""
        total = linear_weight_bytes(self.lm_head) + self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            total += sum(linear_weight_bytes(x) for x in layer.linears())
            total += sum(t.numel() * t.element_size() for t in layer.norms())
        return total

    def experts_profile(self) -> ExpertsProfile | None:
        """The experts FFNs' routing shape and one expert's share of a one-row step's bytes (None: dense)."""
        moe = [layer.ffn for layer in self.layers if isinstance(layer.ffn, ExpertsMLP)]
        if not moe:
            return None
        n_experts, top_k = moe[0].routing.n_experts, moe[0].routing.top_k
        expert_bytes = sum(linear_weight_bytes(f) for f in moe[0].experts[0].linears())
        step_bytes = self.weight_bytes() - len(moe) * (n_experts - top_k) * expert_bytes  # the experts one row runs
        return ExpertsProfile(len(moe), n_experts, top_k, expert_bytes / max(1, step_bytes))

    def take_experts_run(self) -> int | None:
        moe = [layer.ffn for layer in self.layers if isinstance(layer.ffn, ExpertsMLP)]
        return take_experts_run(moe) if moe else None

    # -- paged KV cache ------------------------------------------------------
    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` positions takes over every layer (K and V)."""
        row_bytes = sum(f.row_bytes(self.head_dim) for f in self.kv_formats)  # a K row and a V row
        return len(self.layers) * self.n_kv_heads * block_size * row_bytes

    def new_kv_cache(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> PagedKVCache:
        """A pool of ``num_blocks`` blocks for :meth:`forward_batch` (the engine owns it)."""
        pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        # Uninitialized: attention reads only positions a pass has written (<= each row's own), so
        # zeroing would only cost time (and on a CPU, touch every page of a budget mostly unused).
        k, v = (
            [
                torch.empty(
                    (num_blocks, self.n_kv_heads, block_size, f.row_width(self.head_dim)),
                    dtype=f.dtype,
                    device=self.device,
                )
                for _ in self.layers
            ]
            for f in self.kv_formats
        )
        return PagedKVCache(pool, k, v, self.key_affine())

    def key_affine(self) -> list[torch.Tensor] | None:
        """The affine this target's caches store their keys with (``kernels/kv_formats.py``); None without
        calibration tokens or for keys not rotated."""
        return self._key_affine

    def reads_cache(self, cache: PagedKVCache) -> bool:
        """Whether :meth:`forward_batch` can run on ``cache``, built by another executor (the
        target over the same model, drafting in its blocks): one K and V pool per layer of this
        executor's head shape and device, in formats its layers take (a draft then writes its rows
        in the cache's formats, which the target's verification pass overwrites)."""
        k, v = cache.k, cache.v
        if not (k and len(k) == len(self.layers) == len(v) and k[0].device == self.device):
            return False
        formats = [pool_format(t, self.head_dim) for t in (k[0], v[0])]
        return (
            all(t.dim() == 4 and t.shape[1] == self.n_kv_heads for t in k + v)
            and None not in formats
            and (not self.cpu_kernels or all(f.code is not None for f in formats))
        )

    def kv_policy_unsupported(self) -> str | None:
        reason = check_rope_shift(self._rotary)
        return None if reason is None else f"this model cannot shift keys: {reason}"

    @torch.inference_mode()
    def move_kv(
        self, cache: PagedKVCache, src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor, lanes=None
    ) -> None:
        """Move K and V rows from (block, offset) ``src`` [n, 2] to ``dst`` [n, 2], each key re-rotated by
        ``shift`` [n] positions with each layer's own RoPE (``fastdecode.kv.policy``), in every layer and
        KV head, or only in the (layer, KV head) ``lanes`` [n, 2] given. All rows are read before any is
        written, so sources and destinations may overlap. A quantized key is widened, re-rotated and
        quantized again (each move rounds it once more: the policy decides the moves from accepted
        tokens only, so speculation meets the very same rows)."""
        reason = self.kv_policy_unsupported()
        if reason is not None:
            raise ConfigError(reason)
        tables = self._rope_rows(shift.abs())  # key -> (cos, sin) [n, D] at |shift|
        sign = torch.where(shift < 0, -1.0, 1.0)[:, None]
        (sb, so), (db, do) = src.unbind(1), dst.unbind(1)
        affines = cache.k_affine or [None] * len(self.layers)
        for i, (layer, k_pool, v_pool, a) in enumerate(zip(self.layers, cache.k, cache.v, affines)):
            cos, sin = tables[layer.rope]
            kf = pool_format(k_pool, self.head_dim)
            sin = sin * sign.to(sin.dtype)
            if lanes is None:
                # a quantized key: its values (the affine undone) re-rotated, then stored again (deterministic, per row)
                k = kf.store(rotate_keys(kf.load(k_pool[sb, :, so], a), cos, sin), a)  # [n, KV, D]
                v = v_pool[sb, :, so]  # values move as they are held
                k_pool[db, :, do] = k
                v_pool[db, :, do] = v
                continue
            r = (lanes[:, 0] == i).nonzero()[:, 0]  # this layer's rows
            h = lanes[r, 1]
            ah = None if a is None else a[h, :3]  # [rows, 3, D]: each row's KV head's mu, 1 / s, s
            k = kf.store(rotate_keys(kf.load(k_pool[sb[r], h, so[r]], ah)[:, None], cos[r], sin[r])[:, 0], a, heads=h)
            v = v_pool[sb[r], h, so[r]]
            k_pool[db[r], h, do[r]] = k
            v_pool[db[r], h, do[r]] = v

    # -- forward over ragged rows --------------------------------------------
    # Row invariance. Each row of a pass must get exactly the bits it would get
    # in any other pass - a one-token decode step, a verification of K + 1 rows,
    # a prefill chunk of any size, next to any other requests' rows. Speculative
    # output equal to plain output, and a request's output independent of the
    # batch and of how its prompt was chunked, then hold by construction. On
    # fastdecode's kernels (``kernels/cpu.c``, float32 and int8 weights on x86-64
    # with AVX2) every operation is computed row by row in a fixed order: the
    # GEMM reduces each output alone whatever the row count, attention reduces
    # each (row, head) alone over its own sequence's blocks. On torch's ops
    # (other dtypes and devices, ``float_kernel="torch"``, int4) attention runs
    # one query row at a time with a decode step's SDPA call, and each linear
    # layer's rows are cut into chunks whose sizes lie in one row-count group
    # within which it is invariant (padded with zero rows up to the group's
    # smallest size). The group is found by probing this model's own layers
    # once (``_probe_row_invariance``): measured on the CPUs we run, MKL's fp32
    # F.linear is invariant only within groups ({1}, {2, 3}, {4..15} on a
    # Sapphire Rapids), torch's packed int4 kernel and bf16 F.linear were; SDPA
    # is not across query counts.
    ROWS_PROBED = 16

    def _probe_row_invariance(self) -> tuple[int, int]:
        """The widest [a, b] with a >= 1 such that each linear layer gives every row of
        an m-row call (a <= m <= b) the bits it gets in the (m - 1)-row call. Only the layers
        :meth:`_lin` calls in row groups are run: a ``row_invariant`` one (fastdecode's kernels) is
        called whole, and gives every row count the same bits by construction (the kernels' tests)."""
        first, hidden = self.layers[0], self.embed.shape[1]
        layers = [(first.qkv, hidden), (first.o, self.n_heads * self.head_dim), *first.ffn.probe_layers(hidden)]
        layers += [(self.lm_head, hidden)]
        grouped = [(f, n) for f, n in layers if not getattr(f, "row_invariant", False)]
        if not grouped:
            return 1, self.ROWS_PROBED
        return probe_row_group(grouped, self.ROWS_PROBED, self.device, self.dtype)

    def _lin(self, f: Linear, x: torch.Tensor) -> torch.Tensor:
        """``f(x)`` with every row's bits independent of the row count (see above). x: [n, in]."""
        if getattr(f, "row_invariant", False):
            return f(x)  # invariant for any row count, by construction
        rows_min, rows_max = self.row_group
        out = []
        for i in range(0, x.shape[0], rows_max):
            chunk = x[i : i + rows_max]
            real = chunk.shape[0]
            if real < rows_min:
                chunk = torch.cat([chunk, chunk.new_zeros(rows_min - real, chunk.shape[1])])
            out.append(f(chunk)[:real])
        return torch.cat(out)

    def _rope_rows(self, positions: torch.Tensor) -> dict:
        """key -> (cos, sin) [n, head_dim] at ``positions``, from the model's own rotary
        module (so scaling variants match); Gemma 3's takes the layer type; NoPE layers' are cos 1, sin 0."""
        needed = int(positions.max()) + 1
        have = next(iter(self._rope_tables.values()))[0].shape[0] if self._rope_tables else 0
        if needed > have:
            length = min(max(needed, 2 * have, 256), self.context_length)
            table_pos = torch.arange(length, device=self.device)[None]
            probe = torch.empty(1, dtype=self.dtype, device=self.device)
            for key in {layer.rope for layer in self.layers}:
                if key == NOPE:  # no position encoding: a rotation by 0 (so every RoPE consumer serves these layers)
                    ones = torch.ones(length, self.head_dim, dtype=self.dtype, device=self.device)
                    self._rope_tables[key] = (ones, torch.zeros_like(ones))
                    continue
                cos, sin = self._rotary(probe, table_pos) if key is None else self._rotary(probe, table_pos, key)
                if cos.shape[-1] * 2 == self.head_dim:  # gpt-oss's module gives each frequency once: the
                    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # halves' rotation, as ours
                self._rope_tables[key] = (cos[0], sin[0])
        idx = positions.to(self.device)
        return {key: (cos[idx], sin[idx]) for key, (cos, sin) in self._rope_tables.items()}

    @torch.inference_mode()
    def forward_batch(self, cache: PagedKVCache, entries: Sequence[BatchEntry], observe=None) -> torch.Tensor:
        """One forward over the rows of many sequences (``BatchEntry``: its tokens, the
        position of the first, its block table, how many of its last rows need logits).
        Writes each row's K and V at its position; returns the logits of the rows asked
        for, entry by entry, [sum num_logits, vocab]. Every row's bits are independent of
        the other rows and entries (see above). ``observe``: a layer-by-layer observer in place of
        H2O's (``kv/calibration.py``)."""
        B = cache.pool.block_size
        ids, pos, seq, logit_rows, mirrors, first_rows = [], [], [], [], [], []
        max_blocks = max((len(e.block_table) for e in entries), default=1) or 1
        tables = torch.zeros(len(entries), max_blocks, dtype=torch.int64)
        for s, e in enumerate(entries):
            n = len(e.token_ids)
            if n == 0 or not 0 <= e.num_logits <= n or e.start < len(e.shared):
                raise ValueError(
                    f"batch entry {s}: {n} tokens at {e.start}, {e.num_logits} logits, {len(e.shared)} shared positions"
                )
            if e.start + n > min(len(e.block_table) * B, self.context_length):
                raise ConfigError(
                    f"positions up to {e.start + n} exceed the block table or the context length "
                    f"({self.context_length})"
                )
            tables[s, : len(e.block_table)] = torch.as_tensor(e.block_table, dtype=torch.int64)
            first_row = len(ids)
            first_rows.append(first_row)
            for p, (src, index) in enumerate(e.shared, start=e.start - len(e.shared)):
                if not (0 <= src < s and 0 <= index < len(entries[src].token_ids) and entries[src].start + index == p):
                    raise ValueError(
                        f"batch entry {s}: shared position {p} must be a row of an earlier entry "
                        f"at the same position, got entry {src} index {index}"
                    )
                mirrors.append((first_rows[src] + index, s, p))
            ids.extend(int(t) for t in e.token_ids)
            pos.extend(range(e.start, e.start + n))
            seq.extend([s] * n)
            logit_rows.extend(range(first_row + n - e.num_logits, first_row + n))
        if not ids:
            return torch.empty(0, self.vocab_size)
        rows = PagedRows(
            torch.tensor(pos, dtype=torch.int64),
            torch.tensor(seq, dtype=torch.int64),
            tables,
            B,
            torch.tensor(mirrors, dtype=torch.int64) if mirrors else None,
        )
        x = self.embed[torch.as_tensor(ids, dtype=torch.long, device=self.device)]  # [n, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self._rope_rows(rows.pos)
        # H2O's attention (fastdecode.kv.policy): layer by layer, where the queries are at hand
        # (the per-layer kernels give the bits the layer stack gives: tests/kv/test_kv_policy.py)
        observe = observe or AttentionObserver(entries, first_rows, B, self.scale, self.arch.attn_softcap)
        affines = cache.k_affine or [None] * len(self.layers)  # the keys' affine: the cache's (kv_formats)
        if self._layer_calls is not None and not observe:
            x = self._run_layer_stack(x, rope, cache, rows)
        else:
            for layer, k_pool, v_pool, affine in zip(self.layers, cache.k, cache.v, affines):
                cos, sin = rope[layer.rope]
                x = forward(layer, self._ops, x, k_pool, v_pool, rows, cos, sin, self.scale, observe or None, affine)
            observe.deliver()
        if not logit_rows:
            return torch.empty(0, self.vocab_size)
        x = self._ops.norm(x[torch.as_tensor(logit_rows, device=self.device)].contiguous(), self.final_norm)
        logits = self._lin(self.lm_head, x)
        if self.arch.logit_divisor != 1.0:  # Granite divides its logits (in the model's dtype, as transformers)
            logits = logits / self.arch.logit_divisor
        if self.arch.final_softcap is not None:  # Gemma 2 caps them
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return logits.float()  # [num_logits, vocab]
