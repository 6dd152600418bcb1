"""``fastdecode throughput``: many requests at once on the continuous-batching engine.

For each (weights, drafter, concurrency C) the engine runs with ``max_num_seqs=C``
and a closed loop keeps C requests in flight (a new one is added as soon as one
finishes, as ``vllm bench serve --max-concurrency`` does), over the same
``--num-requests`` prompts every time. Reported per run:

* aggregate output tokens/s = all new tokens / wall time of the run;
* TTFT (request added -> first token), p50 and p99;
* ITL, inter-token latency: the gaps between a request's successive outputs,
  each spread evenly over the tokens it carried (a verified draft delivers several
  tokens at once), p50 and p99;
* acceptance (tau, tokens per verification step) for drafted runs;
* whether every greedy output equals the same prompt decoded alone by plain
  decoding (batch invariance, checked on every run).

A warm-up round (one request per slot, a few tokens) runs before each measured
run and is excluded. Then, once per weights setting, the prefix cache: the TTFT
of a request whose ``--prefix-tokens``-token prefix (a shared system prompt) is
already cached, against the same request on an engine without prefix caching.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastdecode.args import EngineArgs
from fastdecode.errors import ConfigError
from fastdecode.util.commands import ArgumentParser, int_list, run_main
from fastdecode.util.files import check_output_dir, staged_dir

WARMUP_TOKENS = 8


@dataclass
class ThroughputRun:
    weights: str
    drafter: str
    concurrency: int
    num_requests: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    tau: float | None  # tokens per verification step (bonus included), drafted runs only
    identical_to_solo_plain: bool | None  # greedy only
    speedup_vs_plain: float | None = None  # against the plain run at the same weights and concurrency


@dataclass
class PrefixRun:
    weights: str
    prefix_tokens: int
    prompt_tokens: int
    ttft_cold_s: float  # prefix caching off
    ttft_cached_s: float  # the prefix already cached by an earlier request
    cached_tokens: int


@dataclass
class ThroughputReport:
    machine: dict[str, Any]
    settings: dict[str, Any]
    runs: list[ThroughputRun] = field(default_factory=list)
    prefix: list[PrefixRun] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), numpy's linear interpolation; 0 for no values."""
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else 0.0


def run_closed_loop(
    engine, prompts: Sequence[str | list[int]], concurrency: int, chat: bool | None, **options
) -> tuple[list, float, list[float], list[float]]:
    """Decode every prompt with at most ``concurrency`` in flight. Returns (results in
    prompt order, wall seconds, TTFTs, inter-token latencies)."""
    pending = list(enumerate(prompts))[::-1]
    index: dict[str, int] = {}
    results: list = [None] * len(prompts)
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    ttfts, itls = [], []
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and engine.num_running + engine.num_waiting < concurrency:
            i, prompt = pending.pop()
            request_id = engine.add_request(prompt, chat=chat, **options)
            index[request_id] = i
            added[request_id] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            if out.token_ids:
                if rid not in last:
                    ttfts.append(now - added[rid])
                else:
                    itls.extend([(now - last[rid]) / len(out.token_ids)] * len(out.token_ids))
                last[rid] = now
            if out.finished:
                results[index[rid]] = out.result
    return results, time.perf_counter() - t0, ttfts, itls


def _engine(model, tokenizer, target, drafter: str, concurrency: int, enable_prefix_caching: bool = True):
    """An engine on the shared target: ``drafter`` with its own defaults, ``concurrency`` requests at once;
    request options (``draft_tree`` included) come with each request."""
    from fastdecode.drafters import build_drafter
    from fastdecode.engine import GenerationConfig

    engine_args = EngineArgs(max_num_seqs=concurrency, enable_prefix_caching=enable_prefix_caching)
    return engine_args.create_engine(
        GenerationConfig(),
        model=model,
        tokenizer=tokenizer,
        target=target,
        drafter=None if drafter == "none" else build_drafter(drafter),
    )


def measure(
    model,
    tokenizer,
    target,
    weights: str,
    drafters: Sequence[str],
    concurrencies: Sequence[int],
    prompts: Sequence[str],
    max_new_tokens: int,
    chat: bool | None,
    temperature: float,
    seed: int,
    progress=None,
    generation: dict | None = None,
) -> list[ThroughputRun]:
    options = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    solo_options = dict(options)
    options.update(generation or {})
    greedy = temperature == 0
    solo = None
    if greedy:  # the reference: every prompt decoded alone, plainly
        engine = _engine(model, tokenizer, target, "none", 1)
        solo = [r.token_ids for r in run_closed_loop(engine, prompts, 1, chat, **solo_options)[0]]
        engine.free_kv_cache()
    runs: list[ThroughputRun] = []
    for concurrency in concurrencies:
        plain_tps = None
        for drafter in drafters:
            engine = _engine(model, tokenizer, target, drafter, concurrency)
            run_closed_loop(engine, prompts[:concurrency], concurrency, chat, max_new_tokens=WARMUP_TOKENS)
            results, wall_s, ttfts, itls = run_closed_loop(engine, prompts, concurrency, chat, **options)
            engine.free_kv_cache()
            tokens = sum(r.num_new_tokens for r in results)
            steps = sum(r.acceptance.steps for r in results if r.acceptance is not None)
            step_tokens = sum(r.acceptance.step_tokens for r in results if r.acceptance is not None)
            run = ThroughputRun(
                weights=weights,
                drafter=drafter,
                concurrency=concurrency,
                num_requests=len(prompts),
                output_tokens=tokens,
                wall_s=wall_s,
                output_tokens_per_s=tokens / wall_s,
                ttft_p50_s=percentile(ttfts, 50),
                ttft_p99_s=percentile(ttfts, 99),
                itl_p50_s=percentile(itls, 50),
                itl_p99_s=percentile(itls, 99),
                tau=step_tokens / steps if steps else None,
                identical_to_solo_plain=None if solo is None else [r.token_ids for r in results] == solo,
            )
            if drafter == "none":
                plain_tps = run.output_tokens_per_s
            elif plain_tps:
                run.speedup_vs_plain = run.output_tokens_per_s / plain_tps
            runs.append(run)
            if progress:
                progress(run)
    return runs


def measure_prefix(model, tokenizer, target, weights: str, prefix_tokens: int, chat: bool | None) -> PrefixRun:
    """TTFT of a request whose long prefix is cached, against the same request uncached."""
    from fastdecode.bench.datasets import DatasetOptions, load_samples

    text = " ".join(s.prompt for s in load_samples(["suite"], DatasetOptions()))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if prefix_tokens + 24 > target.context_length:
        raise ConfigError(f"--prefix-tokens {prefix_tokens} does not fit the model's context ({target.context_length})")
    while len(ids) < prefix_tokens:
        ids = ids + ids
    prefix = ids[:prefix_tokens]
    questions = [
        tokenizer(q, add_special_tokens=False)["input_ids"]
        for q in ("\nQuestion: what is the first topic above?\nAnswer:", "\nQuestion: name one number above.\nAnswer:")
    ]
    cold = _engine(model, tokenizer, target, "none", 1, enable_prefix_caching=False)
    cold.generate(prefix[:64] + questions[0], max_new_tokens=2)  # warm-up
    cold_result = cold.generate(prefix + questions[1], max_new_tokens=2)
    cold.free_kv_cache()
    warm = _engine(model, tokenizer, target, "none", 1)
    warm.generate(prefix + questions[0], max_new_tokens=2)  # caches the prefix's full blocks
    cached = warm.generate(prefix + questions[1], max_new_tokens=2)
    warm.free_kv_cache()
    assert cached.token_ids == cold_result.token_ids
    return PrefixRun(
        weights=weights,
        prefix_tokens=prefix_tokens,
        prompt_tokens=cached.num_prompt_tokens,
        ttft_cold_s=cold_result.ttft_s,
        ttft_cached_s=cached.ttft_s,
        cached_tokens=cached.num_cached_prompt_tokens,
    )


def render_markdown(report: ThroughputReport) -> str:
    from fastdecode.bench.report import cpu_line, md_table

    m, s = report.machine, report.settings
    lines = [
        "# fastdecode throughput",
        "",
        cpu_line(m),
        f"- torch {m['torch']} ({m['torch_threads']} threads), fastdecode {m['fastdecode']}, {m['date']}",
        f"- model {s['model']}, {s['num_requests']} requests ({s['prompts']}), {s['max_new_tokens']} new tokens each, "
        f"temperature {s['temperature']}; concurrency C = C requests in flight, engine max_num_seqs = C",
        "",
    ]
    rows = [
        [
            r.weights,
            r.drafter,
            r.concurrency,
            f"{r.output_tokens_per_s:.1f}",
            "-" if r.speedup_vs_plain is None else f"{r.speedup_vs_plain:.2f}x",
            f"{r.ttft_p50_s * 1000:.0f}",
            f"{r.ttft_p99_s * 1000:.0f}",
            f"{r.itl_p50_s * 1000:.1f}",
            f"{r.itl_p99_s * 1000:.1f}",
            "-" if r.tau is None else f"{r.tau:.2f}",
            {None: "-", True: "yes", False: "NO"}[r.identical_to_solo_plain],
        ]
        for r in report.runs
    ]
    lines.append(
        md_table(
            [
                "weights",
                "drafter",
                "C",
                "output tok/s",
                "vs plain",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "ITL p50 ms",
                "ITL p99 ms",
                "tau",
                "identical",
            ],
            rows,
        )
    )
    if report.prefix:
        lines += ["", "Prefix cache (TTFT of a request whose prefix an earlier request left cached):", ""]
        lines.append(
            md_table(
                ["weights", "prompt tokens", "cached tokens", "TTFT uncached ms", "TTFT cached ms", "ratio"],
                [
                    [
                        p.weights,
                        p.prompt_tokens,
                        p.cached_tokens,
                        f"{p.ttft_cold_s * 1000:.0f}",
                        f"{p.ttft_cached_s * 1000:.0f}",
                        f"{p.ttft_cold_s / p.ttft_cached_s:.1f}x",
                    ]
                    for p in report.prefix
                ],
            )
        )
    return "\n".join(lines) + "\n"


def add_throughput_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "throughput",
        help="aggregate tokens/s, TTFT and inter-token latency with many requests at once",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    EngineArgs.add_cli_args(
        p,
        only=("model", "dtype", "device", "weights", "float_kernel", "kv_cache_dtype"),
        sweep=("weights",),
        defaults={"weights": "float"},  # the documented runs name their weights; float unless told
    )
    EngineArgs.add_cli_args(p, only=("drafter", "draft_tree"), sweep=("drafter",), defaults={"drafter": "none,ngram"})
    p.add_argument("--concurrency", type=int_list, default=(1, 2, 4, 8, 16), help="comma list (default: 1,2,4,8,16)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="per request (default: %(default)s)")
    p.add_argument("--datasets", default="suite,humaneval", help="prompt sets, taken in turn (default: %(default)s)")
    p.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": ...} per line (instead of --datasets)')
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default): outputs are checked")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-tokens", type=int, default=1000, help="cached-prefix TTFT check; 0 skips it (default: %(default)s)"
    )
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=None, help="directory for throughput.json and throughput.md (default: print only)")
    p.set_defaults(func=cmd_throughput)
    return p


def _prompts(datasets: list[str], n: int, prompts_file: str | None = None) -> tuple[list[str], str]:
    """``n`` distinct prompts, taken from the datasets in turn (distinct so that the prefix
    cache does not turn repeats into free prefills)."""
    from fastdecode.bench.datasets import DatasetOptions, load_samples, read_prompts_jsonl

    if prompts_file is not None:
        datasets = [prompts_file]
        pools = [read_prompts_jsonl(prompts_file)]
    else:
        pools = [load_samples([d], DatasetOptions()) for d in datasets]
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < n and any(pools):
        for pool in pools:
            while pool:
                sample = pool.pop(0)
                if sample.prompt not in seen:
                    seen.add(sample.prompt)
                    prompts.append(sample.prompt)
                    break
            if len(prompts) == n:
                break
    if len(prompts) < n:
        raise ConfigError(
            f"--datasets {','.join(datasets)} hold only {len(prompts)} distinct prompts; "
            f"lower --num-requests or add a dataset"
        )
    return prompts, ", ".join(datasets)


def _check_throughput_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Validate the options; returns the weights formats and the drafters to run (plain first)."""
    from fastdecode.drafters import available_drafters

    for name, value, low in (
        ("--num-requests", args.num_requests, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--prefix-tokens", args.prefix_tokens, 0),
        ("--threads", args.threads, 1),
    ):
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if any(c < 1 for c in args.concurrency):
        raise ConfigError("--concurrency values must be >= 1")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    formats = EngineArgs.choices("weights")
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    bad = [w for w in weights if w not in formats] or ([] if weights else ["(none)"])
    if bad:
        raise ConfigError(f"--weights: expected a comma list of {', '.join(formats)}, got {args.weights!r}")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    unknown = [d for d in drafters if d != "none" and d not in available_drafters()]
    if unknown:
        raise ConfigError(f"--drafters: unknown drafter(s) {', '.join(unknown)}")
    if "none" in drafters:
        drafters.remove("none")
    drafters.insert(0, "none")
    return weights, drafters


def _throughput_settings(
    args: argparse.Namespace, weights: list[str], drafters: list[str], source: str
) -> dict[str, Any]:
    """The settings throughput.json and throughput.md record."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "weights": weights,
        "drafters": drafters,
        "concurrency": list(args.concurrency),
        "num_requests": args.num_requests,
        "max_new_tokens": args.max_new_tokens,
        "prompts": source,
        "temperature": args.temperature,
        "seed": args.seed,
        "prefix_tokens": args.prefix_tokens,
        "draft_tree": args.draft_tree,
        "kv_cache_dtype": args.kv_cache_dtype,
    }


def _show_run(run: ThroughputRun) -> None:
    """One line per finished run, as it finishes."""
    same = {None: "", True: ", identical", False: ", OUTPUT DIFFERS"}[run.identical_to_solo_plain]
    print(
        f"{run.weights:5} {run.drafter:6} C={run.concurrency:<3} {run.output_tokens_per_s:7.1f} tok/s  "
        f"TTFT p50 {run.ttft_p50_s * 1000:6.0f} ms  ITL p50 {run.itl_p50_s * 1000:5.1f} ms "
        f"p99 {run.itl_p99_s * 1000:5.1f} ms{same}",
        flush=True,
    )


def _measure_weights(
    args: argparse.Namespace,
    engine_args: EngineArgs,
    model,
    tokenizer,
    weights: list[str],
    drafters: list[str],
    prompts: list[str],
    report: ThroughputReport,
) -> None:
    """For each weights format: every (drafter, C) run, then the prefix-cache check (unless
    --prefix-tokens 0), into ``report``."""
    chat = False if args.no_chat else None
    for w in weights:
        target = dataclasses.replace(engine_args, weights=w).create_target(model, tokenizer)
        report.runs += measure(
            model,
            tokenizer,
            target,
            w,
            drafters,
            args.concurrency,
            prompts,
            args.max_new_tokens,
            chat,
            args.temperature,
            args.seed,
            progress=_show_run,
            generation={"draft_tree": args.draft_tree},
        )
        if args.prefix_tokens:
            report.prefix.append(measure_prefix(model, tokenizer, target, w, args.prefix_tokens, chat))


def _write_throughput(out_dir: str, report: ThroughputReport, settings: dict[str, Any], text: str) -> None:
    """throughput.md and throughput.json into ``out_dir``, all at once."""
    with staged_dir(out_dir, marker="throughput.json") as out:
        (out / "throughput.md").write_text(text)
        (out / "throughput.json").write_text(
            json.dumps(
                {
                    "machine": report.machine,
                    "settings": settings,
                    "runs": [asdict(r) for r in report.runs],
                    "prefix": [asdict(p) for p in report.prefix],
                },
                indent=1,
            )
        )


def cmd_throughput(args: argparse.Namespace) -> int:
    import torch

    from fastdecode.bench.report import machine_description

    weights, drafters = _check_throughput_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.out:
        check_output_dir(args.out, "throughput results", allow_nonempty_if=lambda p: (p / "throughput.json").exists())
    prompts, source = _prompts(
        [d.strip() for d in args.datasets.split(",") if d.strip()], args.num_requests, args.prompts
    )
    engine_args = EngineArgs.from_cli_args(args, weights="float", drafter="none")  # one of each swept option
    model, tokenizer = engine_args.load_model()
    settings = _throughput_settings(args, weights, drafters, source)
    report = ThroughputReport(machine_description(), settings)
    _measure_weights(args, engine_args, model, tokenizer, weights, drafters, prompts, report)
    text = render_markdown(report)
    print("\n" + text)
    if args.out:
        _write_throughput(args.out, report, settings, text)
    if any(r.identical_to_solo_plain is False for r in report.runs):
        print("fastdecode: warning: some batched outputs differ from the same prompt decoded alone", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="fastdecode")
    add_throughput_parser(parser.add_subparsers(dest="command", required=True))
    return run_main(parser, argv)
