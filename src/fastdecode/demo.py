"""The README's first command: plain vs speculative decoding side by side - the n-gram drafter,
and (float32 on the CPU) the model drafting for itself from its own GGUF blocks."""

from __future__ import annotations

import platform

import torch
from rich.console import Console
from rich.table import Table

from fastdecode.backends import make_target
from fastdecode.drafters import build_drafter
from fastdecode.drafters.factory import DrafterOptions
from fastdecode.engine import Engine, GenerationConfig
from fastdecode.loading import load_model, resolve_spec
from fastdecode.suite import builtin_suite

DEMO_CATEGORIES = ("summarize", "qa", "code")


def run_demo(
    model_spec: str, max_new_tokens: int = 128, device: str = "cpu", dtype: str = "float32", backend: str = "auto", weights: str = "float",
    trust_remote_code: bool = False, float_kernel: str = "auto", kv_cache_dtype: str = "auto",
) -> int:
    """Print plain vs n-gram decoding on a few suite prompts; 1 if their tokens differ (a bug), else 0.

    ``backend``, ``weights``, ``float_kernel`` and ``kv_cache_dtype`` go to :func:`make_target`.
    """
    console = Console()
    console.print(f"[bold]fastdecode demo[/] - {model_spec}, greedy, {max_new_tokens} new tokens, "
                  f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with console.status("loading model"):
        model, tokenizer = load_model(model_spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        target = make_target(model, backend, weights, float_kernel, kv_cache_dtype)
    kernel = f", {target.float_kernel} kernels" if target.float_kernel else ""
    console.print(f"backend {target.name}, weights {target.weights}, dtype {dtype}{kernel}")
    if getattr(target, "kernel_note", None):
        console.print(f"note: {target.kernel_note}")
    plain = Engine(model, tokenizer, target=target)
    # Cost-aware K: the draft length that pays on this hardware (docs/benchmarks.md).
    ngram = Engine(model, tokenizer, drafter=build_drafter("ngram", n=5, k=7), target=target,
                   config=GenerationConfig(draft_k=7, cost_aware_k=True))
    # Float32 on the CPU: the model's own GGUF blocks (a GGUF model; else Q8_0) drafting for it
    # in its KV cache - float32's exact output at about twice its speed (docs/benchmarks.md §6g).
    self_draft = None
    if target.name == "native" and weights == "float" and dtype == "float32" and device == "cpu":
        quant = "gguf" if resolve_spec(model_spec).kind == "gguf" else "q8_0"
        drafter = DrafterOptions(name="draft-model", k=7, draft_quant=quant).build(model, tokenizer, dtype=dtype, device=device)
        self_draft = Engine(model, tokenizer, drafter=drafter, target=target, config=GenerationConfig(draft_k=7, cost_aware_k=True))
    suite = builtin_suite()
    samples = [next(s for s in suite if s.category == c) for c in DEMO_CATEGORIES]
    for engine in (plain, ngram, self_draft):  # warm-up, excluded from figures
        if engine is not None:
            engine.generate(samples[0].prompt, max_new_tokens=8)

    table = Table(title="tok/s: plain vs ngram (ANPD, N=5, cost-aware K <= 14)"
                  + (" vs self (its own GGUF blocks drafting)" if self_draft else ""))
    table.add_column("task", min_width=9)
    columns = ["new", "plain", "ngram", "x", "tau"] + (["self", "x", "tau"] if self_draft else [])
    for col in (*columns, "same"):
        table.add_column(col, justify="right")
    all_identical = True
    for sample in samples:
        base = plain.generate(sample.prompt, max_new_tokens=max_new_tokens)
        spec = ngram.generate(sample.prompt, max_new_tokens=max_new_tokens)
        same = base.token_ids == spec.token_ids
        acc = spec.acceptance
        row = [sample.category, str(base.num_new_tokens), f"{base.decode_tokens_per_s:.1f}", f"{spec.decode_tokens_per_s:.1f}",
               f"{base.wall_s / spec.wall_s:.2f}x", f"{acc.tau:.2f}"]
        if self_draft is not None:
            own = self_draft.generate(sample.prompt, max_new_tokens=max_new_tokens)
            same &= own.token_ids == base.token_ids
            row += [f"{own.decode_tokens_per_s:.1f}", f"{base.wall_s / own.wall_s:.2f}x", f"{own.acceptance.tau:.2f}"]
        all_identical &= same
        table.add_row(*row, "yes" if same else "[red]NO[/]")
        console.print(f"[dim]{sample.category}:[/] {spec.text[:160]!r}")
    console.print(table)
    console.print("x = plain wall time / the drafter's wall time, same prompt, same run; tau = tokens a step, bonus "
                  "token counted; same = token-identical to plain")
    if not all_identical:
        console.print("[red]outputs differ: this is a bug in fastdecode[/]")
        return 1
    return 0
