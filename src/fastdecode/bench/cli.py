"""``fastdecode bench``: which drafter and settings to use on this model and machine.

Wired into the main CLI by ``add_bench_parser(subparsers)``; also runnable on
its own as ``python -m fastdecode.bench.cli bench ...``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys

from fastdecode.args import EngineArgs
from fastdecode.errors import ConfigError
from fastdecode.util.commands import ArgumentParser, bounded, int_list, positive_int, run_main
from fastdecode.util.files import check_output_dir

DEFAULT_DRAFTERS = "none,ngram,prompt-lookup"
DEFAULT_PEERS = "hf,hf-prompt-lookup,hf-assisted,llama-cpp"
# --quick: a few short samples, to check the harness end to end (explicit options still win)
QUICK = {"limit": 2, "max_new_tokens": 16, "repeats": 1, "warmup": 1}
DEFAULTS = {"limit": None, "max_new_tokens": 128, "repeats": 1, "warmup": 1}


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _choices(text: str, option: str) -> list[str]:
    """The comma list ``text`` of values of EngineArgs' ``option``, each one it takes."""
    values, allowed = _csv(text), EngineArgs.choices(option)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        flag = "--" + option.replace("_", "-")
        raise ConfigError(f"{flag}: expected a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return values


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand (all its options, ``func=cmd_bench``) to ``subparsers``."""
    b = subparsers.add_parser(
        "bench",
        help="benchmark drafters and settings on a model (tables, JSONL, plots)",
        description="Measure plain decoding, each drafter and the peers over a prompt set; write results.jsonl, "
        "summary.json, report.md and PNG plots into --out.",
    )
    _add_model_args(b.add_argument_group("models"))
    _add_drafter_args(b.add_argument_group("drafters"))
    _add_prompt_args(b.add_argument_group("prompts"))
    _add_measurement_args(b.add_argument_group("measurement"))
    _add_output_args(b.add_argument_group("output"))
    _add_long_context_args(b.add_argument_group("long context (--long-context)"))
    b.set_defaults(func=cmd_bench)
    return b


def _add_model_args(m) -> None:
    EngineArgs.add_cli_args(
        m,
        only=(
            "model",
            "dtype",
            "device",
            "backend",
            "weights",
            "float_kernel",
            "kv_cache_dtype",
            "trust_remote_code",
            "threads",
        ),
        sweep=("model", "dtype", "backend", "weights", "float_kernel"),
        # the documented comparisons (transformers, llama.cpp) name their weights; float unless told
        defaults={"weights": "float"},
    )
    m.add_argument("--no-chat", action="store_true", help="send raw prompts, without the chat template")


def _add_drafter_args(d) -> None:
    from fastdecode.bench.peers import PEER_CHOICES
    from fastdecode.bench.sweeps import SWEEPS

    EngineArgs.add_cli_args(
        d,
        only=("drafter", "ngram_n", "draft_k", "adaptive_k", "cost_aware_k", "draft_tree", "speculation_guard"),
        sweep=("drafter", "ngram_n", "draft_k"),
        defaults={"drafter": DEFAULT_DRAFTERS},
    )
    d.add_argument(
        "--sweep", default="", help=f"comma list of sweeps: {', '.join(SWEEPS.names())} (ngram-nk: N 2..6 x K 1..10)"
    )
    d.add_argument(
        "--peers",
        default=DEFAULT_PEERS,
        help=f"comma list of {', '.join(PEER_CHOICES)}, or none; missing ones are skipped with a note (default: %(default)s)",
    )
    EngineArgs.add_cli_args(
        d,
        only=("draft_model", "draft_quant"),
        sweep=("draft_quant",),
        help_text={
            "draft_model": "draft model spec for hf-assisted and the draft-model drafter (default for draft-model: the target itself)"
        },
    )


def _add_prompt_args(s) -> None:
    from fastdecode.bench.datasets import DATASETS

    s.add_argument(
        "--datasets",
        default=None,
        help=f"comma list of {', '.join(DATASETS.names())} (default: suite, or only --prompts/--dataset-file when given)",
    )
    s.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": ..., "category": ...} per line')
    s.add_argument(
        "--dataset-file",
        action="append",
        default=[],
        metavar="[FORMAT=]PATH",
        help="local json/jsonl/parquet dataset; FORMAT cnn_dailymail, xsum or prompt (default: from its columns); repeatable",
    )
    s.add_argument("--limit", type=int, default=None, help="samples per category (default: all)")


def _add_measurement_args(g) -> None:
    g.add_argument("--max-new-tokens", type=int, default=None, help="default: 128")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); identity is checked only when greedy"
    )
    g.add_argument(
        "--repeats", type=int, default=None, help="runs per sample and config; the median is reported (default: 1)"
    )
    g.add_argument("--warmup", type=int, default=None, help="discarded warm-up runs per config (default: 1)")
    g.add_argument("--seed", type=int, default=0, help="sample i uses seed SEED + i (default: %(default)s)")
    g.add_argument(
        "--background-load",
        type=bounded(int, "an integer >= 0", low=0),
        default=0,
        metavar="N",
        help="keep N busy processes running while the run measures (each takes a core; stopped when it ends), "
        "to compare plain, speculative and the peers on a busy machine (default: %(default)s)",
    )
    g.add_argument(
        "--quick", action="store_true", help="2 samples per category, 16 new tokens, 1 repeat: checks the harness"
    )
    g.add_argument(
        "--quality",
        action="store_true",
        help="also score each target: perplexity, top-1 agreement and KL vs float on the WikiText-2 test text",
    )
    g.add_argument(
        "--quality-windows",
        type=positive_int,
        default=2,
        metavar="N",
        help="windows of 2048 tokens --quality scores per target (default: %(default)s)",
    )


def _add_output_args(o) -> None:
    o.add_argument("--out", default=None, help="output directory (default: ./fastdecode-bench-<date-time>)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_long_context_args(g) -> None:
    g.add_argument(
        "--long-context",
        action="store_true",
        help="instead of the drafter matrix: prefill and decode tok/s and KV cache MiB at long prompts per KV "
        "cache type and policy, perplexity per cache type vs a float32 cache, and llama.cpp with its cache types "
        "when --peers has llama-cpp (bench/long_context.py)",
    )
    g.add_argument(
        "--context-tokens",
        type=int_list,
        default=None,
        help="prompt lengths in tokens, of WikiText-2's test text (default: 1024,2048,4096,8192; --quick: 256,512)",
    )
    g.add_argument(
        "--kv-cache-dtypes",
        default=None,
        help="comma list of --kv-cache-dtype values (default: --kv-cache-dtype when given, else "
        "float32,float16,q8_0,q4_0)",
    )
    g.add_argument("--kv-policies", default="full", help="comma list of KV policies (default: %(default)s)")
    g.add_argument("--decode-tokens", type=positive_int, default=None, help="new tokens a prompt (default: 32)")
    g.add_argument("--ppl-window", type=positive_int, default=None, help="perplexity window in tokens (default: 4096)")
    g.add_argument(
        "--ppl-windows", type=int, default=None, help="perplexity windows, 0 for none (default: 4; --quick: 1)"
    )


def _one(values: list[str], flag: str) -> str:
    if len(values) != 1:
        raise ConfigError(f"--long-context runs one {flag}, got {', '.join(values)}")
    return values[0]


def _long_context_spec(args: argparse.Namespace):
    from fastdecode.bench.long_context import DEFAULT_KV_CACHE_DTYPES, LongContextSpec
    from fastdecode.loading import DEFAULT_MODEL

    engine_args = EngineArgs(
        model=_one(args.model or [DEFAULT_MODEL], "--model"),
        dtype=_one(_csv(args.dtype), "--dtype"),
        device=args.device,
        backend=_one(_choices(args.backend, "backend"), "--backend"),
        weights=_one(_choices(args.weights, "weights"), "--weights"),
        float_kernel=_one(_choices(args.float_kernel, "float_kernel"), "--float-kernel"),
        trust_remote_code=args.trust_remote_code,
    )
    if args.kv_cache_dtypes is not None:
        kv = _choices(args.kv_cache_dtypes, "kv_cache_dtype")
    else:
        kv = [args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else list(DEFAULT_KV_CACHE_DTYPES)
    quick = args.quick
    return LongContextSpec(
        engine_args,
        kv_cache_dtypes=tuple(kv),
        kv_policies=tuple(_csv(args.kv_policies)),
        context_tokens=args.context_tokens or ((256, 512) if quick else (1024, 2048, 4096, 8192)),
        decode_tokens=args.decode_tokens or (8 if quick else 32),
        repeats=args.repeats or 1,
        ppl_window_tokens=args.ppl_window or (512 if quick else 4096),
        ppl_windows=(1 if quick else 4) if args.ppl_windows is None else args.ppl_windows,
        llama_cpp="llama-cpp" in _csv(args.peers),
    )


def cmd_long_context(args: argparse.Namespace) -> int:
    import torch

    from fastdecode.bench.long_context import run_long_context, tables, write_run

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    spec = _long_context_spec(args)
    out_dir = args.out or f"fastdecode-bench-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    check_output_dir(out_dir, "long-context results", allow_nonempty_if=lambda p: (p / "long_context.json").exists())
    progress = (lambda _: None) if args.no_progress else (lambda text: print(f"[long context] {text}", file=sys.stderr))
    run = run_long_context(spec, progress)
    path = write_run(run, f"{out_dir}/long_context.json")
    text = tables(run)
    path.with_suffix(".md").write_text(text + "\n")
    print(f"{text}\n\nwrote {path} and {path.with_suffix('.md').name}")
    return 0


def _resolved(args: argparse.Namespace, name: str):
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else DEFAULTS)[name]


def _dataset_names(args: argparse.Namespace) -> list[str]:
    if args.datasets is not None:
        names = _csv(args.datasets)
        if args.prompts and "prompts" not in names:
            names.append("prompts")
        return names
    if args.prompts or args.dataset_file:
        return ["prompts"] if args.prompts else []
    return ["suite"]


def _resolved_counts(args: argparse.Namespace) -> tuple:
    """``(limit, max_new_tokens, repeats, warmup)`` after --quick and the defaults, each checked
    (with --seed and --threads) against its lower bound."""
    limit, max_new, repeats, warmup = (_resolved(args, n) for n in ("limit", "max_new_tokens", "repeats", "warmup"))
    for name, value, low in (
        ("--limit", limit, 1),
        ("--max-new-tokens", max_new, 1),
        ("--repeats", repeats, 1),
        ("--warmup", warmup, 0),
        ("--seed", args.seed, 0),
        ("--threads", args.threads, 1),
    ):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    return limit, max_new, repeats, warmup


def _matrix_spec(args: argparse.Namespace, max_new: int):
    """The ``MatrixSpec`` the options describe (plain decoding always among the drafters)."""
    from fastdecode.bench.matrix import MatrixSpec
    from fastdecode.loading import DEFAULT_MODEL

    drafters = _csv(args.drafters)
    if "none" not in drafters:
        drafters.insert(0, "none")
    peers = [] if args.peers.strip() in ("", "none") else _csv(args.peers)
    return MatrixSpec(
        models=tuple(args.model or [DEFAULT_MODEL]),
        dtypes=tuple(_csv(args.dtype)),
        device=args.device,
        backends=tuple(_choices(args.backend, "backend")),
        weights=tuple(_choices(args.weights, "weights")),
        float_kernels=tuple(_choices(args.float_kernel, "float_kernel")),
        kv_cache_dtype=args.kv_cache_dtype,
        drafters=tuple(drafters),
        ngram_ns=tuple(args.ngram_n),
        draft_ks=tuple(args.draft_k),
        adaptive_k=args.adaptive_k,
        cost_aware_k=args.cost_aware_k,
        draft_tree=args.draft_tree,
        speculation_guard=args.speculation_guard,
        max_new_tokens=max_new,
        temperature=args.temperature,
        sweeps=tuple(_csv(args.sweep)),
        peers=tuple(peers),
        draft_model=args.draft_model,
        draft_quants=tuple(_choices(args.draft_quant, "draft_quant")),
        chat=False if args.no_chat else None,
    )


def _checked_out_dir(args: argparse.Namespace) -> str:
    """--out, or a dated default, checked before the run: a bad --out must not cost a whole
    benchmark. (Created when the results are written.)"""
    from fastdecode.bench.report import REPORT_FILE, RESULTS_FILE

    out_dir = args.out or f"fastdecode-bench-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    check_output_dir(
        out_dir,
        "benchmark results",
        allow_nonempty_if=lambda p: (p / RESULTS_FILE).exists() or (p / REPORT_FILE).exists(),
    )
    return out_dir


def _settings(args: argparse.Namespace, spec, run, datasets: list[str], counts: tuple) -> dict:
    """The run's settings, as report.md's table lists them."""
    limit, max_new, repeats, warmup = counts
    return {
        "command": "fastdecode bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "fastdecode bench",
        "models": ", ".join(spec.models),
        "dtypes": ", ".join(spec.dtypes),
        "device": spec.device,
        "backend": ", ".join(spec.backends),
        "weights": ", ".join(spec.weights),
        "float kernel": ", ".join(spec.float_kernels),
        "KV cache dtype": spec.kv_cache_dtype,
        "drafters": ", ".join(spec.drafters),
        "ngram N": ", ".join(map(str, spec.ngram_ns)),
        "K (draft length)": ", ".join(map(str, spec.draft_ks)),
        "adaptive K": spec.adaptive_k,
        "draft tree (paths per step)": spec.draft_tree,
        "speculation guard": "on" if spec.speculation_guard else "off",
        "datasets": ", ".join(datasets + [f"file {f}" for f in args.dataset_file]),
        "samples": len(run.samples),
        "limit per category": limit,
        "max new tokens": max_new,
        "temperature": args.temperature,
        "chat template": "off" if args.no_chat else "when the model has one",
        "repeats": repeats,
        "warm-up runs": warmup,
        "seed": args.seed,
        "sweeps": ", ".join(spec.sweeps) or "none",
        "background load": f"{args.background_load} busy processes" if args.background_load else "none",
        "peers": ", ".join(spec.peers) or "none",
        "draft model": spec.draft_model or "none",
        "draft quant": ", ".join(spec.draft_quants),
    }


def _print_summary(run, paths: dict) -> None:
    """The tables, notes and where the results went on stdout; a warning on stderr where greedy
    speculative outputs differ from plain decoding."""
    from fastdecode.bench.report import config_table
    from fastdecode.bench.summary import summarize_run

    for g in summarize_run(run):
        print(f"\n{g.title}\n\n{config_table(g)}")
    if run.quality:
        from fastdecode.bench.quality import QUALITY_HEADERS, quality_rows
        from fastdecode.bench.report import md_table

        print(f"\nQuality\n\n{md_table(QUALITY_HEADERS, quality_rows(run))}")
    for note in run.notes:
        print(f"note: {note}")
    print(f"\nwrote {paths['report']} ({len(run.rows)} rows in {paths['results'].name})")
    mismatched = [r for r in run.rows if r["identical_to_baseline"] is False and r["peer"] is None]
    if mismatched:  # the figures stand, but greedy speculative decoding promised identical tokens
        print(
            f"fastdecode: warning: {len(mismatched)} greedy speculative output(s) differ from plain decoding "
            f"(see identical_to_baseline in {paths['results'].name})",
            file=sys.stderr,
        )


def cmd_bench(args: argparse.Namespace) -> int:
    if args.long_context:
        return cmd_long_context(args)

    from fastdecode.bench.config import ModelCache
    from fastdecode.bench.datasets import DatasetOptions, load_samples
    from fastdecode.bench.load import background_load
    from fastdecode.bench.matrix import build_matrix
    from fastdecode.bench.report import write_outputs
    from fastdecode.bench.run import run_bench
    from fastdecode.kernels.threads import apply_threads

    counts = _resolved_counts(args)
    limit, max_new, repeats, warmup = counts
    spec = _matrix_spec(args, max_new)
    configs = build_matrix(spec)
    datasets = _dataset_names(args)
    samples = load_samples(datasets, DatasetOptions(limit=limit, prompts_file=args.prompts), args.dataset_file)
    if not samples:
        raise ConfigError("no samples to run: check --datasets, --prompts, --dataset-file and --limit")
    out_dir = _checked_out_dir(args)

    cache = ModelCache(args.trust_remote_code)
    with background_load(args.background_load):
        # (after the load started: the default counts the cores it leaves free; --threads is kept by every target)
        apply_threads(args.threads, fresh=True)
        run = run_bench(
            configs, samples, cache, repeats=repeats, warmup=warmup, seed=args.seed, progress=not args.no_progress
        )
    if args.quality:
        from fastdecode.bench.quality import measure_quality

        measure_quality(run, cache, args.quality_windows)
    paths = write_outputs(out_dir, run, _settings(args, spec, run, datasets, counts), make_plots=not args.no_plots)
    _print_summary(run, paths)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="fastdecode")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return run_main(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
