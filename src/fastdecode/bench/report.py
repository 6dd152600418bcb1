"""Write a run's results: results.jsonl, summary.json, report.md (and the plots, via plots.py)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fastdecode.bench.aggregate import OVERALL, Grid
from fastdecode.bench.load import load_average
from fastdecode.bench.quality import QUALITY_DEFINITION, QUALITY_HEADERS, quality_rows
from fastdecode.bench.run import BenchRun
from fastdecode.bench.summary import GroupSummary, summarize_run, sweep_grids, sweeps_in
from fastdecode.kernels.threads import usable_cpus

RESULTS_FILE, SUMMARY_FILE, REPORT_FILE = "results.jsonl", "summary.json", "report.md"

DEFINITIONS = """\
- **speed-up**: the ANPD paper's ratio - total wall time of plain decoding (fastdecode, drafter `none`) /
  total wall time of the method, over the same samples in the same run (per category, and overall).
- **tok/s**: decode tokens per second (tokens after the first / time after the first), mean and median over samples;
  wall time and speed-up include tokenization and prefill.
- **alpha**: accepted draft tokens / drafted tokens; **tau**: tokens per verification step, counting the bonus token
  (plain decoding: 1); both pooled over all samples. **nodes/step**: draft tokens verified per step (a chain's
  length, or a token tree's nodes with `--draft-tree`). **alpha*K+1**: the ANPD paper's bound on tau.
- **step cost**: per decode step, the mean milliseconds of the target pass that verified it (at batch > 1 a
  shared pass counts whole for each request in it), the ratio to the baseline's pass in the same category (what
  verifying the draft rows added), and the drafter's milliseconds proposing. A method's speed-up is about
  tau x the baseline's step / (its pass + drafting + the engine's own time).
- **identical**: samples whose tokens equal plain decoding's, of those compared (greedy only).
- Under sampling (temperature > 0) each method draws its own tokens, so outputs differ in length: compare tok/s
  there rather than speed-up.
- Peers (`hf ...`, `llama.cpp ...`) tokenize through the same chat template and stop at the same EOS ids and
  token limit; transformers does not report acceptance, so their alpha/tau are blank.
"""


def machine_description() -> dict[str, Any]:
    import torch
    import transformers

    import fastdecode

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = usable_cpus()  # affinity within the cgroup CPU quota
    load = load_average()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "load_average": None if load is None else [round(x, 2) for x in load],  # 1, 5, 15 min, when written
        "gpu": gpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "fastdecode": fastdecode.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align_first_left: bool = True) -> str:
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(":---" if i == 0 and align_first_left else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def config_table(g: GroupSummary) -> str:
    rows = []
    for cfg in g.configs:
        if not cfg.featured:
            continue
        s, a = g.summaries[cfg.name], g.summaries[cfg.name].acceptance
        rows.append(
            [
                cfg.name,
                s.samples,
                s.new_tokens,
                _f(s.mean_tokens_per_s, 1),
                _f(s.median_tokens_per_s, 1),
                _x(s.speedup),
                _f(a and a.alpha),
                _f(a and a.tau),
                _f(a and a.nodes_per_step),
                _f(a and a.alpha_k_bound),
                f"{s.identical}/{s.compared}" if s.compared else "-",
            ]
        )
    return md_table(
        [
            "config",
            "samples",
            "new tokens",
            "mean tok/s",
            "median tok/s",
            "speed-up",
            "alpha",
            "tau",
            "nodes/step",
            "alpha*K+1",
            "identical",
        ],
        rows,
    )


def acceptance_table(g: GroupSummary) -> str | None:
    """Per drafting config and category: tau and the draft tokens verified a step (tau / nodes)."""
    rows = []
    for cfg in g.configs:
        s = g.summaries[cfg.name]
        if cfg.featured and s.acceptance is not None:
            cells = [s.acceptance_by_category.get(c) for c in g.categories]
            rows.append(
                [
                    cfg.name,
                    *(f"{a.tau:.2f} / {a.nodes_per_step:.1f}" if a else "-" for a in cells),
                    f"{s.acceptance.tau:.2f} / {s.acceptance.nodes_per_step:.1f}",
                ]
            )
    return md_table(["config", *g.categories, OVERALL], rows) if rows else None


def source_table(g: GroupSummary) -> str | None:
    """Per drafting config whose drafter names its sources: each source's tokens drafted,
    reached (every token before them accepted) and the share of those accepted."""
    rows = []
    for cfg in g.configs:
        a = g.summaries[cfg.name].acceptance
        if cfg.featured and a is not None:
            for source, (drafted, reached, accepted) in a.by_source.items():
                rows.append([cfg.name, source, drafted, reached, _f(accepted / reached if reached else None)])
    return md_table(["config", "source", "drafted", "reached", "accepted / reached"], rows) if rows else None


def step_cost_table(g: GroupSummary) -> str | None:
    """Per config and category: the pass ms of a decode step, its ratio to the baseline's pass, and
    the drafting ms (``pass (ratio) +draft``); None when no config recorded passes."""
    base = g.summaries[g.baseline.name] if g.baseline is not None else None

    def cell(c, category: str | None) -> str:
        if c is None:
            return "-"
        b = base and (base.step_cost if category is None else base.step_cost_by_category.get(category))
        ratio = f" ({c.pass_ms / b.pass_ms:.2f}x)" if b and b.pass_ms > 0 else ""
        return f"{c.pass_ms:.1f}{ratio} +{c.draft_ms:.1f}"

    rows = []
    for cfg in g.configs:
        s = g.summaries[cfg.name]
        if cfg.featured and s.step_cost is not None:
            rows.append(
                [cfg.name, *(cell(s.step_cost_by_category.get(c), c) for c in g.categories), cell(s.step_cost, None)]
            )
    return md_table(["config", *g.categories, OVERALL], rows) if rows else None


def category_table(g: GroupSummary) -> str:
    rows = []
    for cfg in g.configs:
        if cfg.featured and not cfg.is_baseline:
            s = g.summaries[cfg.name]
            rows.append([cfg.name, *(_x(s.speedup_by_category.get(c)) for c in g.categories), _x(s.speedup)])
    return md_table(["config", *g.categories, OVERALL], rows)


def worst_prompt_table(g: GroupSummary) -> str | None:
    """Per drafting config: the prompt it sped up least, and by how much."""
    rows = []
    for cfg in g.configs:
        w = g.summaries[cfg.name].worst_prompt
        if cfg.featured and not cfg.is_baseline and w is not None:
            rows.append([cfg.name, _x(w.speedup), w.category, w.sample_id])
    return md_table(["config", "worst prompt's speed-up", "category", "sample"], rows) if rows else None


def grid_table(grid: Grid) -> str:
    best = max((v for row in grid.values for v in row if v is not None), default=None)
    rows = [
        [r, *("**" + _x(v) + "**" if v is not None and v == best else _x(v) for v in vals)]
        for r, vals in zip(grid.rows, grid.values)
    ]
    return md_table([f"{grid.row_axis} \\ {grid.col_axis}", *map(str, grid.cols)], rows)


def cpu_line(machine: dict) -> str:
    """The report line naming the processor (and GPU) of a :func:`machine_description`."""
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
    return f"- CPU: {machine['cpu']} ({machine['logical_cores']} logical cores, {machine['usable_cores']} usable){gpu}"


def _section(heading: str, groups: list[GroupSummary], table_of) -> list[str]:
    """A report section of one table per group, the groups without one left out (no section at all if none has)."""
    tables = [(g, table) for g in groups if (table := table_of(g)) is not None]
    if not tables:
        return []
    out = [f"## {heading}", ""]
    for g, table in tables:
        out += [f"### {g.title}", "", table, ""]
    return out


def render_markdown(run: BenchRun, groups: list[GroupSummary], machine: dict, settings: dict, plots: list[str]) -> str:
    out = ["# fastdecode bench", ""]
    out += [
        "## Machine",
        "",
        cpu_line(machine),
        f"- torch {machine['torch']} ({machine['torch_threads']} threads), transformers {machine['transformers']}, "
        f"fastdecode {machine['fastdecode']}, Python {machine['python']}",
        f"- {machine['platform']}",
        f"- date: {machine['date']}",
        *(
            [f"- load average (1, 5, 15 min) when written: {machine['load_average']}"]
            if machine.get("load_average")
            else []
        ),
        "",
        "## Settings",
        "",
    ]
    out += [f"- {k}: {v}" for k, v in settings.items()]
    out += ["", "## Configurations", ""]
    for g in groups:
        out += [f"### {g.title}", "", config_table(g), ""]
    if run.quality:
        out += ["## Quality", "", md_table(QUALITY_HEADERS, quality_rows(run)), ""]
    out += ["## Speed-up per category", ""]
    for g in groups:
        out += [f"### {g.title}", "", category_table(g), ""]
    out += _section("Worst single prompt (speed-up of the prompt sped up least)", groups, worst_prompt_table)
    out += _section("Acceptance per category (tau / draft tokens verified a step)", groups, acceptance_table)
    out += _section(
        "Cost of a decode step per category (target pass ms (x the baseline's pass) +drafting ms)",
        groups,
        step_cost_table,
    )
    out += _section("Acceptance by source", groups, source_table)
    for sweep in sweeps_in(run):
        out += [f"## Sweep `{sweep}`: speed-up", ""]
        for g in groups:
            for category, grid in sweep_grids(g, sweep).items():
                out += [f"### {g.title} - {category}", "", grid_table(grid), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    if run.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in run.notes] + [""]
    out += ["## Definitions", "", DEFINITIONS + (QUALITY_DEFINITION if run.quality else "")]
    return "\n".join(out)


def write_outputs(out_dir: str | Path, run: BenchRun, settings: dict, make_plots: bool = True) -> dict[str, Path]:
    """Write everything into ``out_dir``; returns the paths by kind.

    The files are written beside ``out_dir`` first and moved in when all are complete, the
    report last, so an error or Ctrl-C while writing leaves no half-written file."""
    from fastdecode.util.files import staged_dir

    out = Path(out_dir)
    groups = summarize_run(run)
    machine = machine_description()
    with staged_dir(out, marker=REPORT_FILE) as tmp:
        with open(tmp / RESULTS_FILE, "w", encoding="utf-8") as fh:
            for row in run.rows:
                fh.write(json.dumps(row) + "\n")
        plots: list[Path] = []
        if make_plots:
            from fastdecode.bench.plots import write_plots

            plots = [out / p.name for p in write_plots(tmp, run, groups)]
        summary = {
            "machine": machine,
            "settings": settings,
            "notes": run.notes,
            "configs": [{**cfg.to_dict(), **g.summaries[cfg.name].to_dict()} for g in groups for cfg in g.configs],
            "quality": [r.to_dict() for r in run.quality.values()],
        }
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
        (tmp / REPORT_FILE).write_text(
            render_markdown(run, groups, machine, settings, [str(p) for p in plots]), encoding="utf-8"
        )
    paths = {"results": out / RESULTS_FILE, "summary": out / SUMMARY_FILE, "report": out / REPORT_FILE}
    paths.update({p.stem: p for p in plots})
    return paths
