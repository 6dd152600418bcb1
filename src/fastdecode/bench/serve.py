"""``fastdecode bench-serve``: load on OpenAI-compatible HTTP servers, fastdecode's and llama.cpp's.

Each server is started as a subprocess on 127.0.0.1 (or one already running is given with
``--url``) and driven by a closed loop of streaming chat completions: for each concurrency C,
C clients each send their next request as soon as their last one ends (``vllm bench serve
--max-concurrency``), greedy. Every server gets the same prompts; within one server, the warm-up
and each concurrency level get prompts no earlier level sent, so a prefix cache answers only
what the prompts share, never a repeat. Reported per (server, C):

* aggregate output tokens/s = all output tokens of the run / its wall time; requests/s;
* TTFT: request sent -> first chunk that carries a token, p50 and p99;
* ITL, inter-token latency: the gaps between a response's successive token-bearing chunks,
  each gap spread evenly over the tokens its chunk carried (speculative decoding delivers
  several tokens per chunk: a chunk of 3 tokens 30 ms after the last counts as three 10 ms
  ITLs), p50 and p99. Per-chunk token counts come from fastdecode's ``fastdecode.tokens``
  chunk field where present; otherwise a response's tokens are spread evenly over its chunks;
* TPOT, time per output token after the first: mean of (e2e - TTFT) / (tokens - 1);
* errors (HTTP or stream errors, timeouts);
* prefix cache hits: the prompt tokens the server's prefix cache answered, of all prompt tokens
  (``usage.prompt_tokens_details.cached_tokens``, where the server reports it).

Output tokens are the server's ``usage.completion_tokens`` (``stream_options.include_usage``)
where it sends them; otherwise ``max_tokens`` for a response that stopped for length, and the
model's tokenizer count of the text for the rest (each request says which). Then, per C, the
ratios fastdecode / llama.cpp of aggregate tokens/s and of p99 TTFT, and how many greedy
texts agree (informational: the two are different numeric implementations of the model).

One warm-up request per server precedes the measured runs and is excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastdecode.args import EngineArgs
from fastdecode.bench.serve_client import (
    Endpoint,
    TokenCounter,
    closed_loop,
    count_missing_tokens,
    model_card,
    one_request,
)
from fastdecode.bench.serve_results import (
    FASTDECODE,
    LLAMA_CPP,
    URL,
    ServeReport,
    compare,
    render_markdown,
    run_line,
    summarize,
)
from fastdecode.bench.serve_servers import SERVERS, ServerProcess, TimeLimitReached, free_port
from fastdecode.errors import ConfigError
from fastdecode.util.commands import ArgumentParser, int_list, run_main
from fastdecode.util.files import check_output_dir, staged_dir

WARMUP_TOKENS = 8


# ---------------------------------------------------------------- the command


def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench-serve",
        help="load on OpenAI-compatible servers: throughput, TTFT, ITL at several concurrencies",
        description=" ".join(__doc__.split("\n\n")[1].split()),
    )
    EngineArgs.add_cli_args(
        p, only=("model",), help_text={"model": "model spec; llama-cpp needs a GGUF file (default: %(default)s)"}
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--servers",
        default=f"{FASTDECODE},{LLAMA_CPP}",
        help=f"comma list of servers to start: {FASTDECODE}, {LLAMA_CPP} (default: %(default)s)",
    )
    where.add_argument(
        "--url", default=None, help="benchmark the server already running here instead (http://host:port)"
    )
    p.add_argument("--api-key", default=None, help="with --url: sent as 'Authorization: Bearer KEY'")
    EngineArgs.add_cli_args(
        p,
        only=("weights", "drafter"),
        defaults={"drafter": "ngram"},
        help_text={
            "weights": "fastdecode serve --weights (default: %(default)s)",
            "drafter": "fastdecode serve --drafter (default: %(default)s)",
        },
    )
    p.add_argument("--serve-args", default="", help="more options for `fastdecode serve`, one shell-quoted string")
    p.add_argument("--concurrency", type=int_list, default=(1, 4, 8, 16), help="comma list (default: 1,4,8,16)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per run (default: 2*C, at least 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--datasets", default="suite,humaneval", help="prompt sets, taken in turn (default: %(default)s)")
    p.add_argument(
        "--prompts-file", default=None, help='JSONL file, one {"prompt": ...} per line (instead of --datasets)'
    )
    p.add_argument("--no-chat", action="store_true", help="send raw prompts to /v1/completions instead of chat")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="per request (default: %(default)s)")
    p.add_argument(
        "--start-timeout-s", type=float, default=600.0, help="for a server to become ready (default: %(default)s)"
    )
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=1800.0,
        help="for the whole command; when reached it stops and reports what was measured (default: %(default)s)",
    )
    p.add_argument("--out", default=None, help="directory for results.json, results.md and the servers' logs")
    p.set_defaults(func=cmd_bench_serve)
    return p


def _check_args(args: argparse.Namespace) -> list[str]:
    """Validate the options; returns the server names to run."""
    for name, value in (("--num-requests", args.num_requests), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    for name, value in (
        ("--request-timeout-s", args.request_timeout_s),
        ("--start-timeout-s", args.start_timeout_s),
        ("--time-limit-s", args.time_limit_s),
    ):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{name} must be a number of seconds > 0, got {value}")
    if any(c < 1 for c in args.concurrency):
        raise ConfigError(f"--concurrency values must be >= 1, got {','.join(map(str, args.concurrency))}")
    if len(set(args.concurrency)) != len(args.concurrency):
        raise ConfigError(f"--concurrency lists a value twice: {','.join(map(str, args.concurrency))}")
    try:
        shlex.split(args.serve_args)
    except ValueError as exc:
        raise ConfigError(f"--serve-args: {exc}") from None
    if args.api_key is not None and args.url is None:
        raise ConfigError("--api-key is for a server given with --url (the servers this command starts need none)")
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise ConfigError(f"--url must start with http:// or https://, got {args.url!r}")
        return [URL]
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if not names:
        raise ConfigError("--servers: expected a comma list of server names")
    for name in names:
        SERVERS.get(name)  # ConfigError naming the choices
    if len(set(names)) != len(names):
        raise ConfigError(f"--servers lists a server twice: {args.servers}")
    return names


def _version(distribution: str) -> str | None:
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return None


def _measure_server(
    name: str,
    endpoint: Endpoint,
    args: argparse.Namespace,
    prompts: Sequence[str],
    requests_per_c: dict[int, int],
    deadline: float,
    report: ServeReport,
    counter: TokenCounter,
) -> None:
    """The warm-up request, then one closed-loop run per concurrency; raises TimeLimitReached."""
    timeout_s = max(0.1, min(args.request_timeout_s, deadline - time.monotonic()))
    warm = asyncio.run(one_request(endpoint, prompts[0], min(WARMUP_TOKENS, args.max_new_tokens), timeout_s))
    first = 1  # prompts[0] is the warm-up's; each level takes the next unused ones
    if warm.error is not None:
        if time.monotonic() >= deadline:
            raise TimeLimitReached(f"during the {name} warm-up request")
        hint = " (a model without a chat template needs --no-chat)" if "chat template" in warm.error else ""
        raise ConfigError(f"the {name} server failed the warm-up request: {warm.error}{hint}")
    for c in args.concurrency:
        if time.monotonic() >= deadline:
            raise TimeLimitReached(f"before {name} C={c}")
        n = requests_per_c[c]
        records, wall_s, complete = asyncio.run(
            closed_loop(
                endpoint,
                prompts[first : first + n],
                c,
                args.request_timeout_s,
                deadline,
                server=name,
                first_index=first,
            )
        )
        first += n
        count_missing_tokens(records, counter)
        run = summarize(name, c, n, records, wall_s, complete)
        report.runs.append(run)
        report.requests.extend(records)
        print(run_line(run), flush=True)
        if not complete:
            raise TimeLimitReached(f"during {name} C={c}")


def _start_and_measure(
    name: str,
    args: argparse.Namespace,
    prompts: Sequence[str],
    requests_per_c: dict[int, int],
    deadline: float,
    report: ServeReport,
    counter: TokenCounter,
    logs: Path,
) -> None:
    """Start server ``name`` (or note why it is skipped), measure it, stop it."""
    kind = SERVERS.get(name)
    why = kind.unavailable(args)
    if why:
        print(f"fastdecode: note: skipping the {name} server: {why}", file=sys.stderr)
        report.servers[name] = {"skipped": why}
        return
    port = free_port()
    argv = kind.command(args, port)
    info: dict[str, Any] = {
        "command": shlex.join(["python", *argv[1:]]),
        "version": _version("llama_cpp_python") if name == LLAMA_CPP else None,
    }
    report.servers[name] = info
    print(f"starting {name}: {shlex.join(argv)}", flush=True)
    server = ServerProcess(kind, argv, port, logs / f"{name}.log")
    try:
        server.wait_ready(args.start_timeout_s, deadline)
        info["model_card"] = card = model_card(server.url, {})
        endpoint = Endpoint(server.url, card["id"], not args.no_chat, args.max_new_tokens, {}, kind.extra_body)
        _measure_server(name, endpoint, args, prompts, requests_per_c, deadline, report, counter)
    finally:
        server.stop()


def _serve_settings(
    args: argparse.Namespace, names: list[str], requests_per_c: dict[int, int], source: str
) -> dict[str, Any]:
    """The settings results.json and results.md record."""
    return {
        "model": args.model,
        "servers": names,
        "url": args.url,
        "weights": args.weights,
        "drafter": args.drafter,
        "serve_args": args.serve_args,
        "concurrency": list(args.concurrency),
        "num_requests": {str(c): n for c, n in requests_per_c.items()},
        "max_new_tokens": args.max_new_tokens,
        "prompts": source,
        "chat": not args.no_chat,
        "request_timeout_s": args.request_timeout_s,
        "time_limit_s": args.time_limit_s,
    }


def _measure_all(
    args: argparse.Namespace,
    names: list[str],
    remote: Endpoint | None,
    prompts: Sequence[str],
    requests_per_c: dict[int, int],
    deadline: float,
    report: ServeReport,
    counter: TokenCounter,
    logs: Path,
) -> list[str]:
    """Measure the server at --url (``remote``) or start and measure each of ``names`` in turn;
    returns the errors of those that would not start or answer (the others still run). Reaching
    --time-limit-s stops the measuring and is noted in ``report``."""
    failures: list[str] = []
    try:
        if remote is not None:
            _measure_server(URL, remote, args, prompts, requests_per_c, deadline, report, counter)
        else:
            for name in names:
                try:
                    _start_and_measure(name, args, prompts, requests_per_c, deadline, report, counter, logs)
                except ConfigError as exc:
                    failures.append(str(exc))
                    report.servers.setdefault(name, {})["failed"] = str(exc)
                    print(
                        f"fastdecode: note: the {name} server failed (the error follows at the end)",
                        file=sys.stderr,
                        flush=True,
                    )
    except TimeLimitReached as exc:
        report.stopped_early = f"--time-limit-s {args.time_limit_s:g} reached {exc}"
        print(f"fastdecode: note: {report.stopped_early}; reporting what was measured", file=sys.stderr)
    return failures


def _finish_report(report: ServeReport, counter: TokenCounter) -> None:
    """The comparisons between servers, and the notes on how output tokens were counted."""
    report.comparisons = compare(report.runs, report.requests)
    if counter.failed:
        report.notes.append(f"no tokenizer for counting output tokens ({counter.failed}): chunks counted instead")
    if any(r.tokens_counted_by == "tokenizer" for r in report.requests):
        report.notes.append(
            "some servers sent no usage counts: those outputs were counted with the model's "
            "tokenizer (re-tokenized text; max_tokens for responses that stopped for length)"
        )


def _write_results(out_dir: str, report: ServeReport, settings: dict[str, Any], text: str, logs: Path) -> None:
    """results.md, results.json and the servers' logs into ``out_dir``, all at once."""
    with staged_dir(out_dir, marker="results.json") as out:
        (out / "results.md").write_text(text)
        for log in logs.iterdir():
            (out / log.name).write_bytes(log.read_bytes())
        (out / "results.json").write_text(
            json.dumps(
                {
                    "machine": report.machine,
                    "settings": settings,
                    "servers": report.servers,
                    "runs": [asdict(r) for r in report.runs],
                    "comparisons": [asdict(c) for c in report.comparisons],
                    "notes": report.notes,
                    "stopped_early": report.stopped_early,
                    "requests": [asdict(r) for r in report.requests],
                },
                indent=1,
            )
        )


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from fastdecode.bench.report import machine_description
    from fastdecode.bench.throughput import _prompts

    start = time.monotonic()
    deadline = start + args.time_limit_s
    names = _check_args(args)
    if args.out:
        check_output_dir(args.out, "bench-serve results", allow_nonempty_if=lambda p: (p / "results.json").exists())
    requests_per_c = {c: args.num_requests or max(2 * c, 8) for c in args.concurrency}
    try:  # distinct: the warm-up's, then each level's own
        prompts, source = _prompts(
            [d.strip() for d in args.datasets.split(",") if d.strip()],
            1 + sum(requests_per_c.values()),
            args.prompts_file,
        )
    except ConfigError as exc:
        levels = ", ".join(f"C={c}: {n}" for c, n in requests_per_c.items())
        raise ConfigError(f"{exc} (each level sends prompts no earlier level sent: 1 warm-up + {levels})") from None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url is not None:
        url = args.url.rstrip("/").removesuffix("/v1")
        card = model_card(url, headers)  # ConfigError when unreachable, before any work
    settings = _serve_settings(args, names, requests_per_c, source)
    report = ServeReport(machine_description(), settings)
    counter = TokenCounter(args.model)
    remote = None
    if args.url is not None:
        report.servers[URL] = {"command": f"(already running at {url})", "model_card": card}
        remote = Endpoint(url, card["id"], not args.no_chat, args.max_new_tokens, headers)
    with tempfile.TemporaryDirectory(prefix="fastdecode-bench-serve-") as logs:
        # a server that would not start or answer: reported after the others ran
        failures = _measure_all(args, names, remote, prompts, requests_per_c, deadline, report, counter, Path(logs))
        _finish_report(report, counter)
        text = render_markdown(report)
        print("\n" + text)
        if args.out:
            _write_results(args.out, report, settings, text, Path(logs))
    if failures:
        raise ConfigError(
            failures[0] if len(failures) == 1 else f"{len(failures)} servers failed: " + "; ".join(failures)
        )
    if any(r.errors for r in report.runs):
        print("fastdecode: warning: some requests failed (see the errors column)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="fastdecode")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_main(parser, argv)
