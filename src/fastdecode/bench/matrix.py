"""The matrix of configurations one ``fastdecode bench`` run measures.

For every model x dtype: the plain-decoding baseline (always), each drafter at
each of its settings (N x K for ``ngram``, K for the others), the points of
each sweep, and each peer. A sweep point equal to a drafter configuration is
measured once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastdecode.bench.config import BASELINE_DRAFTER, BenchConfig
from fastdecode.bench.peers import PEER_CHOICES, PEERS
from fastdecode.bench.sweeps import drafter_config, sweep_configs
from fastdecode.drafters import available_drafters
from fastdecode.drafters.base import readers
from fastdecode.errors import ConfigError
from fastdecode.formats import draft_quant_names


@dataclass(frozen=True)
class MatrixSpec:
    models: tuple[str, ...]
    dtypes: tuple[str, ...] = ("float32",)
    device: str = "cpu"
    backends: tuple[str, ...] = ("auto",)
    weights: tuple[str, ...] = ("float",)
    float_kernels: tuple[str, ...] = ("auto",)  # the native GEMM for float32/int8 weights (make_target's float_kernel)
    kv_cache_dtype: str = "auto"  # the native targets' KV cache (make_target's kv_cache_dtype)
    drafters: tuple[str, ...] = (BASELINE_DRAFTER, "ngram", "prompt-lookup")
    ngram_ns: tuple[int, ...] = (5,)  # ANPD's N
    draft_ks: tuple[int, ...] = (7,)  # ANPD's K
    adaptive_k: bool = False
    cost_aware_k: bool = False
    draft_tree: int | str = 1  # candidate paths per step (GenerationConfig.draft_tree)
    speculation_guard: bool = True  # GenerationConfig.speculation_guard
    max_new_tokens: int = 128
    temperature: float = 0.0
    sweeps: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()  # names in PEER_CHOICES
    draft_model: str | None = None
    draft_quants: tuple[str, ...] = ("none",)  # the draft model's weights (draft-model, hybrid), one config each
    chat: bool | None = None


def baseline_config(
    spec: MatrixSpec, model: str, dtype: str, backend: str = "auto", weights: str = "float", float_kernel: str = "auto"
) -> BenchConfig:
    generation = {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature}
    if spec.adaptive_k:
        generation["adaptive_k"] = True
    if spec.cost_aware_k:
        generation["cost_aware_k"] = True
    if spec.draft_tree != 1:
        generation["draft_tree"] = spec.draft_tree
    if not spec.speculation_guard:
        generation["speculation_guard"] = False
    return BenchConfig(
        name=BASELINE_DRAFTER,
        model=model,
        dtype=dtype,
        device=spec.device,
        backend=backend,
        weights=weights,
        float_kernel=float_kernel,
        kv_cache_dtype=spec.kv_cache_dtype,
        generation_options=generation,
        draft_model=spec.draft_model,
        chat=spec.chat,
    )


def validate(spec: MatrixSpec) -> None:
    if not spec.models:
        raise ConfigError("no model to benchmark: give --model")
    if spec.kv_cache_dtype != "auto" and "hf" in spec.backends:
        raise ConfigError(f"--kv-cache-dtype {spec.kv_cache_dtype} needs the native backend, not hf")
    known = {BASELINE_DRAFTER, *available_drafters()}
    for d in spec.drafters:
        if d not in known:
            raise ConfigError(f"unknown drafter {d!r}; choose from: {', '.join(sorted(known))}")
    for p in spec.peers:
        if p not in PEER_CHOICES:
            raise ConfigError(f"unknown peer {p!r}; choose from: {', '.join(PEER_CHOICES)}")
    for n in spec.ngram_ns:
        if n < 2:
            raise ConfigError(f"--ngram-n must be >= 2, got {n}")
    for k in spec.draft_ks:
        if k < 1:
            raise ConfigError(f"--draft-k must be >= 1, got {k}")
    for q in spec.draft_quants:
        if q not in draft_quant_names():
            raise ConfigError(f"unknown draft quantization {q!r}; choose from: {', '.join(draft_quant_names())}")


def build_matrix(spec: MatrixSpec) -> list[BenchConfig]:
    validate(spec)
    configs: list[BenchConfig] = []
    for model in dict.fromkeys(spec.models):
        kernels = tuple(dict.fromkeys(spec.float_kernels))
        # The kernel choice exists for the native path's float and int8 weights only.
        targets = [
            (d, b, w, f)
            for d in dict.fromkeys(spec.dtypes)
            for b in dict.fromkeys(spec.backends)
            for w in dict.fromkeys(spec.weights)
            for f in (kernels if b != "hf" and w in ("float", "int8") else kernels[:1])
        ]
        for index, (dtype, backend, weights, float_kernel) in enumerate(targets):
            base = baseline_config(spec, model, dtype, backend, weights, float_kernel)
            group = [base]
            for drafter in dict.fromkeys(spec.drafters):
                if drafter == BASELINE_DRAFTER:
                    continue
                ns = spec.ngram_ns if drafter == "ngram" else (None,)
                quants = spec.draft_quants if drafter in readers("draft_model") else (None,)
                group += [
                    drafter_config(base, drafter, n, k, draft_quant=q)
                    for n in ns
                    for k in spec.draft_ks
                    for q in quants
                ]
            for sweep in spec.sweeps:
                for point in sweep_configs(sweep, base):
                    _add_sweep_point(group, point)
            # Peers run their own implementation: measured once per model and dtype.
            first_of_dtype = all(t[0] != dtype for t in targets[:index])
            for choice in dict.fromkeys(spec.peers if first_of_dtype else ()):
                for peer in PEER_CHOICES[choice]:
                    ks = spec.draft_ks if "prompt-lookup" in peer or peer == "hf-assisted" else (None,)
                    for k in ks:
                        cfg = dataclasses.replace(base, peer=peer, peer_options={} if k is None else {"k": k})
                        group.append(dataclasses.replace(cfg, name=PEERS.get(peer).label(cfg)))
            configs += group
    return configs


def _add_sweep_point(group: list[BenchConfig], point: BenchConfig) -> None:
    for i, cfg in enumerate(group):
        if cfg.identity == point.identity:
            group[i] = dataclasses.replace(cfg, sweep=point.sweep, sweep_point=point.sweep_point)
            return
    group.append(point)
