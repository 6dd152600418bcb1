"""PNG plots of a run (matplotlib, Agg backend): one figure per kind, one panel per (model, dtype, device).

* ``speedup_by_category.png`` - grouped bars: speed-up per category per configuration;
* ``<sweep>_heatmap.png`` - speed-up over a sweep's two axes, overall and per category;
* ``tokens_per_s_vs_alpha.png`` - per sample, decode tokens/s against acceptance rate.
"""

from __future__ import annotations

from pathlib import Path

from fastdecode.bench.aggregate import OVERALL
from fastdecode.bench.run import BenchRun
from fastdecode.bench.summary import GroupSummary, sweep_grids, sweeps_in


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        from fastdecode.errors import ConfigError

        raise ConfigError(
            "plots need matplotlib: pip install matplotlib (or fastdecode[bench]), or pass --no-plots"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(out: Path, run: BenchRun, groups: list[GroupSummary]) -> list[Path]:
    plt = _pyplot()
    paths = [speedup_bars(plt, out / "speedup_by_category.png", groups)]
    for sweep in sweeps_in(run):
        path = sweep_heatmap(plt, out / f"{sweep.replace('-', '_')}_heatmap.png", groups, sweep)
        if path is not None:
            paths.append(path)
    paths.append(tokens_per_s_vs_alpha(plt, out / "tokens_per_s_vs_alpha.png", groups))
    return paths


def speedup_bars(plt, path: Path, groups: list[GroupSummary]) -> Path:
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 4 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        configs = [c for c in g.configs if c.featured and not c.is_baseline]
        labels = [*g.categories, OVERALL]
        width = 0.8 / max(len(configs), 1)
        for j, cfg in enumerate(configs):
            s = g.summaries[cfg.name]
            values = [s.speedup_by_category.get(c) for c in g.categories] + [s.speedup]
            xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [v or 0.0 for v in values], width, label=cfg.name)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        ax.set_ylabel("speed-up vs plain decoding")
        ax.set_title(g.title)
        if configs:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_heatmap(plt, path: Path, groups: list[GroupSummary], sweep: str) -> Path | None:
    panels = [(g, name, grid) for g in groups for name, grid in sweep_grids(g, sweep).items()]
    if not panels:
        return None
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (g, name, grid) in zip(axes.flat, panels):
        values = [[float("nan") if v is None else v for v in row] for row in grid.values]
        im = ax.imshow(values, cmap="viridis", aspect="auto", origin="lower")
        for r, row in enumerate(grid.values):
            for c, v in enumerate(row):
                if v is not None:
                    ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white")
        ax.set_xticks(range(len(grid.cols)), [str(c) for c in grid.cols])
        ax.set_yticks(range(len(grid.rows)), [str(r) for r in grid.rows])
        ax.set_xlabel(grid.col_axis)
        ax.set_ylabel(grid.row_axis)
        ax.set_title(f"{g.title}\n{name}", fontsize=9)
        fig.colorbar(im, ax=ax, label="speed-up")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tokens_per_s_vs_alpha(plt, path: Path, groups: list[GroupSummary]) -> Path:
    fig, axes = plt.subplots(len(groups), 1, figsize=(7, 4.5 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        by_drafter: dict[str, tuple[list[float], list[float]]] = {}
        for cfg in g.configs:
            for row in g.rows.get(cfg.name, []):
                if row["acceptance"] is not None:
                    xs, ys = by_drafter.setdefault(row["drafter"], ([], []))
                    xs.append(row["acceptance"]["acceptance_rate"])
                    ys.append(row["decode_tokens_per_s"])
        for drafter, (xs, ys) in by_drafter.items():
            ax.scatter(xs, ys, s=14, alpha=0.7, label=drafter)
        if g.baseline is not None:
            ax.axhline(
                g.summaries[g.baseline.name].median_tokens_per_s,
                color="black",
                linewidth=0.8,
                linestyle="--",
                label="plain decoding (median)",
            )
        ax.set_xlabel("acceptance rate alpha (per sample)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(g.title)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
