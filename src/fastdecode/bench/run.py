"""Run a matrix of configurations over a list of samples and collect one row per (config, sample).

Measurement protocol:

* every model is loaded once; every configuration's runner is built before any
  timing;
* ``warmup`` short generations per runner are run first and discarded;
* then, sample by sample, each repeat runs every configuration once, in an
  order rotated by one per sample, so that drift in the machine's speed (other
  load, heat) spreads over all configurations instead of hitting one;
* sample ``i`` gets seed ``seed + i`` in every configuration;
* a row reports the repeat with the median wall time (all its figures come from
  that one run) and lists every repeat's wall time;
* under greedy decoding a row says whether its tokens equal those of the
  plain-decoding baseline of the same model and dtype in this run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from fastdecode.bench.aggregate import median_repeat
from fastdecode.bench.config import BenchConfig, ModelCache, generation_config
from fastdecode.bench.datasets import BenchSample
from fastdecode.bench.peers import PEERS, EngineRunner, Runner, build_runner
from fastdecode.decoding.metrics import GenerationResult
from fastdecode.util.progress import rich_progress

WARMUP_MAX_NEW_TOKENS = 16


@dataclass
class BenchRun:
    configs: list[BenchConfig]  # those that ran
    samples: list[BenchSample]  # those that ran
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)  # skipped peers, dropped samples
    # BenchConfig.group_key -> the target's fastdecode.evaluation.quality.QualityReport (bench --quality)
    quality: dict[tuple, Any] = field(default_factory=dict)


def run_bench(
    configs: list[BenchConfig],
    samples: list[BenchSample],
    cache: ModelCache,
    *,
    repeats: int = 1,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = True,
) -> BenchRun:
    notes: list[str] = []
    with rich_progress(progress, description="[progress.description]{task.description}") as bar:
        runners, active = _build_runners(configs, cache, bar, notes)
        samples = _fitting_samples(active, runners, samples, notes)
        results = _measure(active, runners, samples, bar, notes, repeats=repeats, warmup=warmup, seed=seed)
    active = [c for c in active if all((id(c), s.sample_id) in results for s in samples)]
    rows = _rows(
        active,
        samples,
        results,
        seed,
        {id(c): (runners[id(c)].target_name, getattr(runners[id(c)], "float_kernel", None)) for c in active},
    )
    return BenchRun(active, samples, rows, notes)


def _build_runners(
    configs: list[BenchConfig], cache: ModelCache, bar, notes: list[str]
) -> tuple[dict[int, Runner], list[BenchConfig]]:
    """Every configuration's runner, built before any timing; a peer that cannot run is skipped with a note."""
    runners: dict[int, Runner] = {}
    active: list[BenchConfig] = []
    loading = bar.add_task("loading models", total=len(configs))
    for cfg in configs:
        runner = _runner(cfg, cache, notes)
        if runner is not None:
            runners[id(cfg)] = runner
            active.append(cfg)
        bar.advance(loading)
    return runners, active


def _runner(cfg: BenchConfig, cache: ModelCache, notes: list[str]) -> Runner | None:
    if cfg.peer is None:
        return build_runner(cfg, cache)
    reason = PEERS.get(cfg.peer).unavailable(cfg)
    if reason:
        _note(notes, f"peer {cfg.name} skipped: {reason}")
        return None
    try:
        return build_runner(cfg, cache)
    except Exception as exc:  # a peer's own failure must not end the run
        _note(notes, f"peer {cfg.name} skipped: {type(exc).__name__}: {_first_line(exc)}")
        return None


def _measure(
    active: list[BenchConfig],
    runners: dict[int, Runner],
    samples: list[BenchSample],
    bar,
    notes: list[str],
    *,
    repeats: int,
    warmup: int,
    seed: int,
) -> dict[tuple[int, str], list[GenerationResult]]:
    """The warm-up runs, then every repeat of every sample on every configuration (the order rotated by one
    per sample); the results per (config, sample)."""

    # A drafter that learns across requests (suffix, recycling, a persistent n-gram memory) must
    # not draft a measured run from the warm-up's output or from an earlier repeat of the same
    # prompt: its memory is snapshotted and put back (earlier samples still teach later ones,
    # as earlier requests do on a server).
    def snapshot() -> dict[int, object]:
        return {id(c): getattr(runners[id(c)], "snapshot", lambda: None)() for c in active}

    def restore(saved: dict[int, object]) -> None:
        for c in active:
            if saved.get(id(c)) is not None:
                runners[id(c)].restore(saved[id(c)])

    before_warmup = snapshot()
    warmup_runs = warmup if samples else 0
    task = bar.add_task("warm-up", total=len(active) * (warmup_runs + len(samples) * repeats))
    for _ in range(warmup_runs):
        for cfg in list(active):
            _guarded(
                cfg,
                active,
                notes,
                runners[id(cfg)].generate,
                samples[0].prompt,
                seed,
                min(WARMUP_MAX_NEW_TOKENS, _max_new(cfg)),
            )
            bar.advance(task)
    restore(before_warmup)

    results: dict[tuple[int, str], list[GenerationResult]] = {}
    for i, sample in enumerate(samples):
        bar.update(task, description=f"{sample.sample_id}")
        shift = i % max(len(active), 1)
        before_sample = snapshot() if repeats > 1 else {}
        for repeat in range(repeats):
            if repeat:
                restore(before_sample)
            for cfg in active[shift:] + active[:shift]:
                if cfg not in active:  # a peer that failed earlier in this loop
                    continue
                out = _guarded(cfg, active, notes, runners[id(cfg)].generate, sample.prompt, seed + i)
                if out is not None:
                    results.setdefault((id(cfg), sample.sample_id), []).append(out)
                bar.advance(task)
    return results


def _max_new(cfg: BenchConfig) -> int:
    return generation_config(cfg).max_new_tokens


def _guarded(cfg: BenchConfig, active: list[BenchConfig], notes: list[str], generate, *args):
    """``generate(*args)``: one generation; a peer that raises is dropped with a note, fastdecode's own errors propagate."""
    if cfg.peer is None:
        return generate(*args)
    try:
        return generate(*args)
    except Exception as exc:
        _note(notes, f"peer {cfg.name} dropped: {type(exc).__name__}: {_first_line(exc)}")
        with contextlib.suppress(ValueError):
            active.remove(cfg)
        return None


def _fitting_samples(active, runners, samples, notes) -> list[BenchSample]:
    """Drop, with a note, samples whose prompt alone fills some model's context."""
    kept = []
    baselines = [runners[id(c)] for c in active if c.is_baseline]
    for s in samples:
        too_long = [
            r.engine
            for r in baselines
            if isinstance(r, EngineRunner) and len(r.engine.encode(s.prompt, r.chat)) >= r.engine.target.context_length
        ]
        if too_long:
            _note(
                notes,
                f"sample {s.sample_id} dropped: its prompt fills the model's context ({too_long[0].target.context_length} tokens)",
            )
        else:
            kept.append(s)
    return kept


def _rows(active, samples, results, seed, target_names) -> list[dict[str, Any]]:
    baseline_of = {c.group_key: c for c in active if c.is_baseline}
    chosen = {key: runs[median_repeat([r.wall_s for r in runs])] for key, runs in results.items()}
    rows = []
    for cfg in active:
        greedy = generation_config(cfg).sampling.greedy
        base_cfg = baseline_of.get(cfg.group_key)
        for i, sample in enumerate(samples):
            runs = results[(id(cfg), sample.sample_id)]
            r = chosen[(id(cfg), sample.sample_id)]
            base = chosen.get((id(base_cfg), sample.sample_id)) if base_cfg is not None else None
            acceptance = None
            if r.acceptance is not None:
                acceptance = {**r.acceptance.to_dict(), "step_tokens": r.acceptance.step_tokens}
            rows.append(
                {
                    **cfg.to_dict(),
                    "is_baseline": cfg.is_baseline,
                    "target": target_names[id(cfg)][0],
                    "float_kernel_used": target_names[id(cfg)][1],  # what "auto" resolved to (native float/int8 only)
                    "dataset": sample.dataset,
                    "category": sample.category,
                    "sample_id": sample.sample_id,
                    "seed": seed + i,
                    "repeats": len(runs),
                    "num_prompt_tokens": r.num_prompt_tokens,
                    "num_new_tokens": r.num_new_tokens,
                    "wall_s": r.wall_s,
                    "wall_s_repeats": [x.wall_s for x in runs],
                    "ttft_s": r.ttft_s,
                    "decode_tokens_per_s": r.decode_tokens_per_s,
                    "finish_reason": r.finish_reason,
                    "decode_passes": r.decode_passes,
                    "decode_pass_s": r.decode_pass_s,
                    "draft_s": r.draft_s,
                    "acceptance": acceptance,
                    "identical_to_baseline": (r.token_ids == base.token_ids) if greedy and base is not None else None,
                    "token_ids": list(r.token_ids),
                    "text": r.text,
                }
            )
    return rows


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
