"""What one benchmark configuration is, and the one place it becomes an engine.

A :class:`BenchConfig` names everything that decides a measurement: the target
model and its dtype, the drafter and its options, the generation options, and
(for a peer) which other implementation runs instead of fastdecode. Models are
loaded once per ``(model, dtype, device)`` by a :class:`ModelCache` and shared
by every configuration that names them.

The target options become :class:`~fastdecode.args.EngineArgs` (:meth:`BenchConfig.engine_args`),
which builds the target and the engine: :func:`build_engine` is the one place a configuration
becomes an engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.args import EngineArgs
from fastdecode.drafters import build_drafter
from fastdecode.drafters.factory import DrafterOptions
from fastdecode.engine import Engine, GenerationConfig
from fastdecode.loading import load_model

BASELINE_DRAFTER = "none"


@dataclass(frozen=True)
class BenchConfig:
    name: str  # human label, unique within one (model, dtype, device): "ngram N=5 K=7", "hf generate"
    model: str  # a load_model spec
    dtype: str = "float32"
    drafter: str = BASELINE_DRAFTER  # a registered drafter name, or "none" for plain decoding
    drafter_options: dict[str, Any] = field(default_factory=dict)  # the drafter's own keywords
    generation_options: dict[str, Any] = field(default_factory=dict)  # GenerationConfig.from_options keywords
    device: str = "cpu"
    backend: str = "auto"  # the target: "auto" | "native" | "hf" (fastdecode.backends.make_target)
    weights: str = "float"  # the target's linear weight precision: "float" | "int8" | "int4"
    float_kernel: str = "auto"  # the native GEMM for float32/int8 weights: "auto" | "rowgemm" | "torch" (make_target)
    kv_cache_dtype: str = (
        "auto"  # what the native target's KV cache holds (make_target): "auto" | "float32" | "float16"
    )
    peer: str | None = None  # None: fastdecode's Engine; else a name in fastdecode.bench.peers.PEERS
    peer_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"k": 7} for a prompt-lookup peer
    draft_model: str | None = None  # a load_model spec for a draft model (hf-assisted)
    chat: bool | None = None  # None: the chat template when the tokenizer has one
    sweep: str | None = None  # the sweep that produced this point, if any
    sweep_point: dict[str, Any] = field(default_factory=dict)  # its coordinates, e.g. {"N": 5, "K": 7}
    featured: bool = True  # in the per-config tables and bar charts (sweep-only points are not)

    @property
    def is_baseline(self) -> bool:
        return self.peer is None and self.drafter == BASELINE_DRAFTER

    @property
    def group_key(self) -> tuple[str, str, str, str, str, str, str]:
        """Configurations with the same group key share a baseline, a model and a target."""
        return (self.model, self.dtype, self.device, self.backend, self.weights, self.float_kernel, self.kv_cache_dtype)

    @property
    def identity(self) -> str:
        """What makes two configurations the same measurement (name and sweep tags aside)."""
        return json.dumps(
            [
                self.model,
                self.dtype,
                self.device,
                self.backend,
                self.weights,
                self.float_kernel,
                self.kv_cache_dtype,
                self.drafter,
                self.drafter_options,
                self.generation_options,
                self.peer,
                self.peer_options,
                self.draft_model,
                self.chat,
            ],
            sort_keys=True,
            default=str,
        )

    def engine_args(self) -> EngineArgs:
        """The model and target options of this configuration (the drafter is built by :func:`build_engine`)."""
        return EngineArgs(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            backend=self.backend,
            weights=self.weights,
            float_kernel=self.float_kernel,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.name,
            "model": self.model,
            "model_label": model_label(self.model),
            "dtype": self.dtype,
            "device": self.device,
            "backend": self.backend,
            "weights": self.weights,
            "float_kernel": self.float_kernel,
            "kv_cache_dtype": self.kv_cache_dtype,
            "drafter": self.drafter,
            "drafter_options": dict(self.drafter_options),
            "generation_options": dict(self.generation_options),
            "peer": self.peer,
            "peer_options": dict(self.peer_options),
            "draft_model": self.draft_model,
            "sweep": self.sweep,
            "sweep_point": dict(self.sweep_point),
            "featured": self.featured,
        }


def model_label(spec: str) -> str:
    """A short name for tables: a built-in name or hub id as given, a path by its last part."""
    text = os.fspath(spec)
    if os.sep in text and Path(text).expanduser().exists():
        return Path(text).name or text
    return text


class ModelCache:
    """Loads each ``(model, dtype, device)`` once and builds each target once.

    Every configuration naming the same model shares its weights, and every
    configuration with the same model, backend and weight precision shares one
    target (a native target holds fused copies of the weights, so one per
    configuration would multiply memory by the size of a sweep). Sharing a
    target is safe because runs are sequential and the engine resets the
    target's cache at the start of each request.
    """

    def __init__(self, trust_remote_code: bool = False) -> None:
        self.trust_remote_code = trust_remote_code
        self._loaded: dict[tuple, tuple[Any, Any]] = {}
        self._targets: dict[tuple, tuple[Any, Any, Any]] = {}

    def get(self, model: str, dtype: str = "float32", device: str = "cpu"):
        """(model, tokenizer), loaded once."""
        key = (model, dtype, device)
        if key not in self._loaded:
            # the float model: peers (transformers) call it, and each configuration's target is built from it
            self._loaded[key] = load_model(
                model, dtype=dtype, device=device, trust_remote_code=self.trust_remote_code, lazy=False
            )
        return self._loaded[key]

    def target(self, cfg: BenchConfig):
        """(model, tokenizer, target) for ``cfg``'s model, backend and weight precision."""
        key = cfg.group_key
        if key not in self._targets:
            model, tokenizer = self.get(cfg.model, cfg.dtype, cfg.device)
            # a target never changes the model: low-bit on transformers' path quantizes a copy
            self._targets[key] = (model, tokenizer, cfg.engine_args().create_target(model, tokenizer))
        return self._targets[key]


def generation_config(cfg: BenchConfig) -> GenerationConfig:
    return GenerationConfig.from_options(**cfg.generation_options)


def build_engine(cfg: BenchConfig, model_cache: ModelCache) -> Engine:
    """The one function that turns a configuration into an :class:`Engine`."""
    model, tokenizer, target = model_cache.target(cfg)
    config = generation_config(cfg)
    if cfg.drafter == BASELINE_DRAFTER:
        drafter = None
    elif DrafterOptions(name=cfg.drafter).needs_target:
        # draft_model / draft_quant / exit_layer / skip_layers, built the CLI's way
        options = DrafterOptions(name=cfg.drafter, k=config.draft_k, **cfg.drafter_options)
        drafter = options.build(model, tokenizer, dtype=cfg.dtype, device=cfg.device)
    else:  # the drafter's own keywords
        drafter = build_drafter(cfg.drafter, **cfg.drafter_options)
    return cfg.engine_args().create_engine(config, model=model, tokenizer=tokenizer, target=target, drafter=drafter)
