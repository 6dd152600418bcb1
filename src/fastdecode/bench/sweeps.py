"""Sweeps: named grids of configurations, one function each in ``SWEEPS``.

A sweep function takes the baseline configuration of one (model, dtype,
device) - its generation options are the run's - and returns the grid's
configurations, each tagged with ``sweep`` and a two-coordinate
``sweep_point`` (first key = heatmap rows). The report and the plots lay out
any such sweep as a heatmap of speed-ups; adding a sweep is adding a function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fastdecode.bench.config import BenchConfig
from fastdecode.drafters.base import readers
from fastdecode.formats import calibrated_draft_quants
from fastdecode.loading import resolve_spec
from fastdecode.registry import Registry

SweepFn = Callable[[BenchConfig], list[BenchConfig]]
SWEEPS: Registry[str, SweepFn] = Registry("sweep")


def register_sweep(name: str) -> Callable[[SweepFn], SweepFn]:
    return SWEEPS.register(name)


def drafter_config(
    base: BenchConfig, drafter: str, n: int | None, k: int, draft_quant: str | None = None, **tags
) -> BenchConfig:
    """A drafter configuration on ``base``'s model and generation options, named after its settings.
    ``draft_quant``: the draft model's weights (for a drafter with a draft model: the target itself, or
    ``base.draft_model``)."""
    adaptive = bool(base.generation_options.get("adaptive_k") or base.generation_options.get("cost_aware_k"))
    if drafter == "ngram":
        options, name = {"n": n, "k": k}, f"ngram N={n} K={k}"
    elif drafter == "prompt-lookup":
        options, name = {"k": k}, f"prompt-lookup K={k}"
    elif drafter in readers("draft_model") and draft_quant is not None:
        options = {"draft_quant": draft_quant, **({"draft_model": base.draft_model} if base.draft_model else {})}
        name = f"{drafter}{'' if draft_quant == 'none' else ' ' + draft_quant} K={k}"
    else:  # a drafter this harness knows no settings for: its defaults, the run's K
        options, name = {}, f"{drafter} K={k}"
    return dataclasses.replace(
        base,
        name=name
        + ((" cost-aware" if base.generation_options.get("cost_aware_k") else " adaptive") if adaptive else ""),
        drafter=drafter,
        drafter_options=options,
        generation_options={**base.generation_options, "draft_k": k},
        **tags,
    )


@register_sweep("ngram-nk")
def ngram_nk(base: BenchConfig) -> list[BenchConfig]:
    """ANPD Figures 3-5: the n-gram drafter over N in 2..6 and K in 1..10."""
    return [
        drafter_config(base, "ngram", n, k, sweep="ngram-nk", sweep_point={"N": n, "K": k}, featured=False)
        for n in range(2, 7)
        for k in range(1, 11)
    ]


QUANTIZED_DRAFTER_K = 4  # Zhang & Li drafted 3-5 tokens per step


@register_sweep("quantized-drafters")
def quantized_drafters(base: BenchConfig) -> list[BenchConfig]:
    """Zhang & Li's Table 1 for this target: a small drafter (``--draft-model``,
    e.g. one made by ``fastdecode distill-drafter``) in float/int8/int4, the
    target itself as an int8/int4/int4-GPTQ/AWQ/SmoothQuant/2:4-sparse drafter, layer-skip, and n-gram."""
    k = QUANTIZED_DRAFTER_K
    rows: list[tuple[str, str, dict]] = []
    if base.draft_model:
        for quant in ("none", "int8", "int4"):
            label = "small" if quant == "none" else f"small {quant}"
            rows.append((label, "draft-model", {"draft_model": base.draft_model, "draft_quant": quant}))
    for quant in ("int8", "int4", "int4-gptq"):
        rows.append((f"target {quant}", "draft-model", {"draft_quant": quant}))
    if base.backend != "hf" and resolve_spec(base.model).kind == "gguf":
        # the target on the integer dot products: requantized to Q8_0, and the file's own blocks
        for quant in ("q8_0", "gguf"):
            rows.append((f"target {quant}", "draft-model", {"draft_quant": quant}))
    if base.backend != "hf":  # the calibrated methods, on the block formats' integer dot products
        for quant in calibrated_draft_quants():
            rows.append((f"target {quant}", "draft-model", {"draft_quant": quant}))
        # pruned: the target's weights 2:4 by magnitude on the sparse q8_0 kernel (a pruned
        # directory made by fastdecode compress drafts as --draft-model DIR: the "small" rows)
        rows.append(("target sparse24", "draft-model", {"draft_quant": "sparse24"}))
    rows.append(("layer-skip", "layer-skip", {}))
    rows.append(("ngram", "ngram", {"n": 5, "k": k}))
    return [
        dataclasses.replace(
            base,
            name=f"{label} K={k}",
            drafter=drafter,
            drafter_options=options,
            generation_options={**base.generation_options, "draft_k": k},
            sweep="quantized-drafters",
            sweep_point={"drafter": label, "K": k},
            featured=True,
        )
        for label, drafter, options in rows
    ]


def sweep_configs(name: str, base: BenchConfig) -> list[BenchConfig]:
    return SWEEPS.get(name)(base)
