"""``bench --quality``: each target's quality beside its speed.

For every target of a run (model, dtype, backend, weights, kernel, KV cache: a report group),
the perplexity of :func:`fastdecode.evaluation.quality.evaluate` over a few windows of the evaluation
text, with top-1 agreement and KL against the float model, on the very target the
benchmark timed (shared through the :class:`~fastdecode.bench.config.ModelCache`).
"""

from __future__ import annotations

from fastdecode.bench.config import ModelCache, model_label
from fastdecode.bench.run import BenchRun
from fastdecode.errors import FastDecodeError
from fastdecode.evaluation.quality import EvalOptions, evaluate

QUALITY_WINDOWS = 2


def measure_quality(run: BenchRun, cache: ModelCache, max_windows: int = QUALITY_WINDOWS) -> None:
    """Fill ``run.quality`` for each target fastdecode ran (peers have none); a target that cannot
    be scored gets a note instead."""
    options = EvalOptions(max_windows=max_windows, decode_tokens=0)
    first: dict[tuple, object] = {}
    for c in run.configs:
        if c.peer is None:
            first.setdefault(c.group_key, c)
    for cfg in first.values():
        try:
            report = evaluate(cfg.engine_args(), options, loaded=cache.target(cfg))
        except FastDecodeError as exc:
            run.notes.append(f"quality of {model_label(cfg.model)} ({cfg.weights} weights): {exc}")
            continue
        run.quality[cfg.group_key] = report


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def quality_rows(run: BenchRun) -> list[list[str]]:
    """One row per scored target, in the run's order."""
    rows = []
    for key in dict.fromkeys(c.group_key for c in run.configs):
        r = run.quality.get(key)
        if r is None:
            continue
        model, dtype, device, _, _, float_kernel, kv_cache_dtype = key
        rows.append(
            [
                f"{model_label(model)}, {dtype}, {device}, {r.backend} backend, {r.weights} weights"
                + (f", {float_kernel} GEMM" if float_kernel != "auto" else "")
                + (f", {kv_cache_dtype} KV cache" if kv_cache_dtype != "auto" else ""),
                _f(r.perplexity, 3),
                _f(r.top1_agreement, 4),
                _f(r.kl, 5),
                f"{r.weight_bytes / 1e6:.1f}",
                f"{r.num_windows} x {r.window_tokens}",
            ]
        )
    return rows


QUALITY_HEADERS = ["target", "perplexity", "top-1 agreement", "KL (nats/token)", "weight MB", "windows x tokens"]
QUALITY_DEFINITION = (
    "- **quality** (`--quality`): perplexity on the WikiText-2 raw test split by the GPTQ/Wanda convention "
    "(non-overlapping windows, each scored alone; the first windows only), top-1 agreement and mean "
    "KL(float || target) against the float model on the same windows; weight MB: bytes a decode step streams.\n"
)
