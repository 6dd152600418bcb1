"""A run's rows grouped by target (model, dtype, device, backend, weights, kernel, KV cache): what the
report's tables and the plots are drawn from."""

from __future__ import annotations

from dataclasses import dataclass

from fastdecode.bench.aggregate import OVERALL, ConfigSummary, Grid, speedups_by_category, summarize_config, sweep_grid
from fastdecode.bench.config import BenchConfig, model_label
from fastdecode.bench.run import BenchRun


@dataclass
class GroupSummary:
    """One (model, dtype, device): its configurations, their rows and summaries, and the categories seen."""

    key: tuple[str, str, str, str, str, str, str]  # BenchConfig.group_key
    baseline: BenchConfig | None
    configs: list[BenchConfig]
    rows: dict[str, list[dict]]  # config name -> rows
    summaries: dict[str, ConfigSummary]  # config name -> summary
    categories: list[str]

    @property
    def title(self) -> str:
        model, dtype, device, backend, weights, float_kernel, kv_cache_dtype = self.key
        base_rows = self.rows.get(self.baseline.name, []) if self.baseline is not None else []
        target = base_rows[0]["target"] if base_rows else backend  # what "auto" resolved to
        kernel = base_rows[0].get("float_kernel_used") if base_rows else None  # what "auto" resolved to
        return (
            f"{model_label(model)}, {dtype}, {device}, {target} backend, {weights} weights"
            + (f", {kernel} GEMM" if kernel else "")
            + (f", {kv_cache_dtype} KV cache" if kv_cache_dtype != "auto" else "")
        )


def summarize_run(run: BenchRun) -> list[GroupSummary]:
    groups: dict[tuple, GroupSummary] = {}
    for cfg in run.configs:
        g = groups.setdefault(cfg.group_key, GroupSummary(cfg.group_key, None, [], {}, {}, []))
        g.configs.append(cfg)
        if cfg.is_baseline:
            g.baseline = cfg
    for row in run.rows:
        g = groups[
            (
                row["model"],
                row["dtype"],
                row["device"],
                row["backend"],
                row["weights"],
                row.get("float_kernel", "auto"),
                row.get("kv_cache_dtype", "auto"),
            )
        ]
        g.rows.setdefault(row["config"], []).append(row)
        if row["category"] not in g.categories:
            g.categories.append(row["category"])
    for g in groups.values():
        base_rows = g.rows.get(g.baseline.name, []) if g.baseline is not None else []
        for cfg in g.configs:
            k = cfg.generation_options.get("draft_k", cfg.peer_options.get("k", 0))
            g.summaries[cfg.name] = summarize_config(g.rows.get(cfg.name, []), base_rows, draft_k=k)
    return list(groups.values())


def sweep_grids(g: GroupSummary, sweep: str) -> dict[str, Grid]:
    """Speed-up grids of one sweep: ``"overall"`` and one per category."""
    points = [c for c in g.configs if c.sweep == sweep]
    base_rows = g.rows.get(g.baseline.name, []) if g.baseline is not None else []
    by_cat = {c.name: speedups_by_category(base_rows, g.rows.get(c.name, [])) for c in points}
    grids = {}
    for category in [OVERALL, *g.categories]:
        grid = sweep_grid((c.sweep_point, by_cat[c.name].get(category)) for c in points)
        if grid is not None:
            grids[category] = grid
    return grids


def sweeps_in(run: BenchRun) -> list[str]:
    return list(dict.fromkeys(c.sweep for c in run.configs if c.sweep))
