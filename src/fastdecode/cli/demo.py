"""The README's first command: plain vs speculative decoding side by side - the n-gram drafter,
and (float32 on the CPU) the model drafting for itself from its own GGUF blocks."""

from __future__ import annotations

import dataclasses
import platform

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from fastdecode.args import EngineArgs
from fastdecode.backends import make_target
from fastdecode.data.suite import builtin_suite
from fastdecode.loading import resolve_spec

DEMO_CATEGORIES = ("summarize", "qa", "code")


def run_demo(
    model_spec: str,
    max_new_tokens: int = 128,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str = "auto",
    weights: str = "auto",
    trust_remote_code: bool = False,
    float_kernel: str = "auto",
    kv_cache_dtype: str = "auto",
) -> int:
    """:func:`demo` of ``model_spec`` with these target options (:class:`EngineArgs`' fields)."""
    engine_args = EngineArgs(
        model=model_spec,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        backend=backend,
        weights=weights,
        float_kernel=float_kernel,
        kv_cache_dtype=kv_cache_dtype,
    )
    return demo(engine_args, max_new_tokens)


def demo(engine_args: EngineArgs, max_new_tokens: int = 128) -> int:
    """Print plain vs n-gram decoding on a few suite prompts; 1 if their tokens differ (a bug), else 0.

    ``engine_args`` gives the model and its target; the demo chooses the drafters. Its third column is
    the model drafting for itself, which needs the float model: ``weights`` ``auto`` is float here.
    """
    a = engine_args if engine_args.weights != "auto" else dataclasses.replace(engine_args, weights="float")
    console = Console()
    console.print(
        f"[bold]fastdecode demo[/] - {a.model}, greedy, {max_new_tokens} new tokens, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    )
    console.print(machine_load_line(a.apply_threads()))
    with console.status("loading model"):
        model, tokenizer = a.load_model()
        # (a.create_target(model, tokenizer), spelled out: tests/cli/test_demo.py watches this module's make_target)
        target = make_target(model, a.backend, a.weights, a.float_kernel, a.kv_cache_dtype, tokenizer=tokenizer)
    kernel = f", {target.float_kernel} kernels" if target.float_kernel else ""
    console.print(f"backend {target.name}, weights {target.weights}, dtype {a.dtype}{kernel}")
    if target.kernel_note:
        console.print(f"note: {target.kernel_note}")
    shared = {"model": model, "tokenizer": tokenizer, "target": target}
    plain = a.create_engine(**shared)
    # Cost-aware K: the draft length that pays on this hardware (docs/benchmarks.md).
    ngram = dataclasses.replace(a, drafter="ngram", ngram_n=5, draft_k=7, cost_aware_k=True).create_engine(**shared)
    # Float32 on the CPU: the model's own GGUF blocks (a GGUF model; else Q8_0) drafting for it
    # in its KV cache - float32's exact output at about twice its speed (docs/benchmarks.md §6g).
    self_draft = None
    if target.name == "native" and a.weights == "float" and a.dtype == "float32" and a.device == "cpu":
        quant = "gguf" if resolve_spec(a.model).kind == "gguf" else "q8_0"
        self_args = dataclasses.replace(a, drafter="draft-model", draft_k=7, draft_quant=quant, cost_aware_k=True)
        self_draft = self_args.create_engine(**shared)
    suite = builtin_suite()
    samples = [next(s for s in suite if s.category == c) for c in DEMO_CATEGORIES]
    for engine in (plain, ngram, self_draft):  # warm-up, excluded from figures
        if engine is not None:
            engine.generate(samples[0].prompt, max_new_tokens=8)

    table = results_table(self_draft is not None)
    all_identical = True
    for sample in samples:
        base = plain.generate(sample.prompt, max_new_tokens=max_new_tokens)
        spec = ngram.generate(sample.prompt, max_new_tokens=max_new_tokens)
        same = base.token_ids == spec.token_ids
        acc = spec.acceptance
        row = [
            sample.category,
            str(base.num_new_tokens),
            f"{base.decode_tokens_per_s:.1f}",
            f"{spec.decode_tokens_per_s:.1f}",
            f"{base.wall_s / spec.wall_s:.2f}x",
            f"{acc.tau:.2f}",
        ]
        if self_draft is not None:
            own = self_draft.generate(sample.prompt, max_new_tokens=max_new_tokens)
            same &= own.token_ids == base.token_ids
            row += [f"{own.decode_tokens_per_s:.1f}", f"{base.wall_s / own.wall_s:.2f}x", f"{own.acceptance.tau:.2f}"]
        all_identical &= same
        table.add_row(*row, "yes" if same else "[red]NO[/]")
        console.print(f"[dim]{sample.category}:[/] {spec.text[:160]!r}")
    console.print(table)
    console.print(
        "ngram: ANPD, N=5, cost-aware K <= 14"
        + ("; self: the model's own GGUF blocks drafting for it" if self_draft is not None else "")
        + ". x = plain wall time / the drafter's wall time, same prompt, same run; tau = tokens a step, bonus "
        "token counted; same = token-identical to plain"
    )
    if not all_identical:
        console.print("[red]outputs differ: this is a bug in fastdecode[/]")
        return 1
    return 0


def machine_load_line(threads: int) -> str:
    """What else the machine is doing as the demo starts, so a poor row on a busy machine says why:
    the cores other processes leave free (measured as the thread count is chosen, from /proc/stat:
    ``fastdecode.kernels.threads.free_cores``; the load average only for the record, as it still
    holds the last minute, a previous run included)."""
    from fastdecode.bench.load import load_average
    from fastdecode.kernels.threads import FREE_CORE_SLACK, free_cores, usable_cpus

    cpus = usable_cpus()
    free = free_cores()
    load = load_average()
    line = f"machine: {cpus} CPUs usable"
    if free is not None:
        line += f", {free:.1f} free"
    if load is not None:
        line += f", load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    line += f", {threads} thread{'s' if threads != 1 else ''}"
    if free is not None and free < threads - FREE_CORE_SLACK:
        line += "\n[yellow]busy: other processes hold the cores these threads need, figures will be low[/]"
    return line


def results_table(with_self: bool) -> Table:
    """The demo's table: at most 80 columns wide (tok/s up to 9999.9, x and tau up to 99.99)."""
    title = "tok/s: plain vs ngram" + (" vs self" if with_self else "")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("task", min_width=9, no_wrap=True)
    columns = ["new", "plain", "ngram", "x", "tau"] + (["self", "x", "tau"] if with_self else [])
    for col in (*columns, "same"):
        table.add_column(col, justify="right", no_wrap=True)
    return table
