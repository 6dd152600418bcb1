"""``fastdecode bench-serve``'s results: one record per streamed request, the figures of a run
(pure functions of the records), fastdecode against llama.cpp, and the report's text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdecode.bench.throughput import percentile

FASTDECODE, LLAMA_CPP, URL = "fastdecode", "llama-cpp", "url"


# ---------------------------------------------------------------- results


@dataclass
class RequestRecord:
    """One streamed request. Times are seconds after the request was sent."""

    server: str
    concurrency: int
    prompt_index: int
    ttft_s: float | None  # first token-bearing chunk; None when none came
    e2e_s: float  # until the stream ended (or failed)
    chunk_times_s: list[float]  # arrival of each token-bearing chunk
    chunk_tokens: list[int] | None  # tokens each of them carried, when the server says (fastdecode does)
    output_tokens: int | None
    tokens_counted_by: str  # "usage" | "server chunks" | "length" (= max_tokens) | "tokenizer" | "chunks"
    finish_reason: str | None
    text: str
    error: str | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens, where the server sends it
    cached_prompt_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens: prefix cache hits


@dataclass
class ServeRun:
    server: str
    concurrency: int
    num_requests: int  # planned
    completed: int  # ended without error
    errors: int
    cancelled: int  # not finished when the time limit stopped the run
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    tpot_mean_s: float
    tokens_counted_by: str  # the sources of output_tokens, e.g. "usage" or "length, tokenizer"
    complete: bool  # False: cut short by --time-limit-s
    first_error: str | None = None
    # Prompt tokens the server's prefix cache answered, of the prompt tokens of the requests that
    # reported them (None: the server reports no cached tokens, as llama-cpp-python's does not).
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefix_cache_hit_rate: float | None = None


@dataclass
class Comparison:
    """fastdecode against llama.cpp at one concurrency."""

    concurrency: int
    output_tokens_per_s_ratio: float | None  # fastdecode / llama.cpp; > 1: fastdecode faster
    ttft_p99_ratio: float | None  # fastdecode / llama.cpp; < 1: fastdecode's p99 TTFT lower
    texts_agree: int  # greedy texts equal, of texts_compared (informational)
    texts_compared: int


@dataclass
class ServeReport:
    machine: dict[str, Any]
    settings: dict[str, Any]
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> command, model card, or why skipped
    runs: list[ServeRun] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stopped_early: str | None = None


# ---------------------------------------------------------------- statistics (pure)


def spread_evenly(total: int, parts: int) -> list[int]:
    """``total`` tokens over ``parts`` chunks as evenly as integers allow: (10, 4) -> [3, 3, 2, 2]."""
    if parts <= 0:
        return []
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def inter_token_latencies(chunk_times_s: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token gaps of one streamed response.

    ``chunk_times_s[i]`` is when the i-th token-bearing chunk arrived, ``chunk_tokens[i]`` how
    many tokens it carried. The gap before chunk i >= 1 is spread evenly over its tokens; the
    first chunk's tokens belong to the TTFT and give none. Example: chunks at 0.5, 0.6 and 0.9 s
    carrying 1, 1 and 3 tokens give [0.1, 0.1, 0.1, 0.1] (the 0.3 s gap is three 0.1 s ITLs).
    """
    itls: list[float] = []
    for i in range(1, len(chunk_times_s)):
        n = chunk_tokens[i]
        if n > 0:
            itls.extend([(chunk_times_s[i] - chunk_times_s[i - 1]) / n] * n)
    return itls


def tokens_per_chunk(record: RequestRecord) -> list[int]:
    """The tokens each token-bearing chunk carried: the server's counts, else the output spread evenly."""
    if record.chunk_tokens is not None:
        return record.chunk_tokens
    return spread_evenly(record.output_tokens or 0, len(record.chunk_times_s))


def summarize(
    server: str,
    concurrency: int,
    num_requests: int,
    records: Sequence[RequestRecord],
    wall_s: float,
    complete: bool = True,
) -> ServeRun:
    """One (server, C) run's figures from its finished requests."""
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    tokens = sum(r.output_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in inter_token_latencies(r.chunk_times_s, tokens_per_chunk(r))]
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.output_tokens and r.output_tokens > 1
    ]
    return ServeRun(
        server=server,
        concurrency=concurrency,
        num_requests=num_requests,
        completed=len(ok),
        errors=len(failed),
        cancelled=num_requests - len(records),
        output_tokens=tokens,
        wall_s=wall_s,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        tpot_mean_s=sum(tpots) / len(tpots) if tpots else 0.0,
        tokens_counted_by=", ".join(sorted({r.tokens_counted_by for r in ok})) or "-",
        complete=complete,
        first_error=failed[0].error if failed else None,
        **_prefix_cache_hits(ok),
    )


def _prefix_cache_hits(records: Sequence[RequestRecord]) -> dict:
    reported = [r for r in records if r.cached_prompt_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_prompt_tokens for r in reported)
    return {
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
    }


def compare(
    runs: Sequence[ServeRun], records: Sequence[RequestRecord], ours: str = FASTDECODE, peer: str = LLAMA_CPP
) -> list[Comparison]:
    """``ours`` / ``peer`` at every concurrency both ran; a ratio is None where the peer's figure is 0."""
    by_key = {(r.server, r.concurrency): r for r in runs}
    texts = {(r.server, r.concurrency, r.prompt_index): r.text for r in records if r.error is None}
    out = []
    for c in sorted({r.concurrency for r in runs}):
        a, b = by_key.get((ours, c)), by_key.get((peer, c))
        if a is None or b is None:
            continue
        pairs = [
            (text, texts[(peer, c, i)])
            for (s, cc, i), text in texts.items()
            if s == ours and cc == c and (peer, c, i) in texts
        ]
        out.append(
            Comparison(
                concurrency=c,
                output_tokens_per_s_ratio=a.output_tokens_per_s / b.output_tokens_per_s
                if b.output_tokens_per_s
                else None,
                ttft_p99_ratio=a.ttft_p99_s / b.ttft_p99_s if b.ttft_p99_s else None,
                texts_agree=sum(x == y for x, y in pairs),
                texts_compared=len(pairs),
            )
        )
    return out


# ---------------------------------------------------------------- rendering


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def _rate(run: ServeRun) -> str:
    return "-" if run.prefix_cache_hit_rate is None else f"{100 * run.prefix_cache_hit_rate:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def run_line(run: ServeRun) -> str:
    cut = "" if run.complete else "  (cut by --time-limit-s)"
    errors = f"  {run.errors} errors" if run.errors else ""
    return (
        f"{run.server:10} C={run.concurrency:<3} {run.output_tokens_per_s:7.1f} tok/s  {run.requests_per_s:5.2f} req/s  "
        f"TTFT p50 {_ms(run.ttft_p50_s):>5} p99 {_ms(run.ttft_p99_s):>5} ms  ITL p50 {_ms(run.itl_p50_s):>5} "
        f"p99 {_ms(run.itl_p99_s):>5} ms  TPOT {_ms(run.tpot_mean_s):>5} ms  prefix cache hits {_rate(run)}{errors}{cut}"
    )


_RUN_COLUMNS = [
    "server",
    "C",
    "done",
    "errors",
    "output tok/s",
    "req/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "TPOT ms",
    "prefix cache hits",
    "tokens counted by",
]


def _header_lines(report: ServeReport) -> list[str]:
    """The title, the machine, the settings and each server's command (or why it was skipped)."""
    from fastdecode.bench.report import cpu_line

    m, s = report.machine, report.settings
    lines = [
        "# fastdecode bench-serve",
        "",
        cpu_line(m),
        f"- fastdecode {m['fastdecode']}, torch {m['torch']}, python {m['python']}, {m['date']}",
        f"- model {s['model']}; {s['prompts']}; {s['max_new_tokens']} new tokens at most per request, greedy, "
        f"{'chat completions' if s['chat'] else 'completions'}, streamed",
        "- concurrency C: C clients, each sending its next request when its last one ends; "
        "requests per run: " + ", ".join(f"{c}: {n}" for c, n in s["num_requests"].items()),
    ]
    for name, info in report.servers.items():
        if info.get("skipped"):
            lines.append(f"- {name}: skipped ({info['skipped']})")
        else:
            lines.append(f"- {name}: `{info['command']}`" + (f" ({info['version']})" if info.get("version") else ""))
    return lines


def _runs_table(runs: list[ServeRun]) -> str:
    """One row per (server, C) run."""
    from fastdecode.bench.report import md_table

    rows = [
        [
            r.server,
            r.concurrency,
            f"{r.completed}/{r.num_requests}",
            r.errors,
            f"{r.output_tokens_per_s:.1f}",
            f"{r.requests_per_s:.2f}",
            _ms(r.ttft_p50_s),
            _ms(r.ttft_p99_s),
            _ms(r.itl_p50_s),
            _ms(r.itl_p99_s),
            _ms(r.tpot_mean_s),
            _rate(r),
            r.tokens_counted_by + ("" if r.complete else " (cut short)"),
        ]
        for r in runs
    ]
    return md_table(_RUN_COLUMNS, rows)


def _comparison_lines(comparisons: list[Comparison]) -> list[str]:
    """fastdecode / llama.cpp ratios per C, after a blank line; none when nothing was compared."""
    from fastdecode.bench.report import md_table

    if not comparisons:
        return []
    table = md_table(
        ["C", "output tok/s ratio", "p99 TTFT ratio", "greedy texts equal"],
        [
            [
                c.concurrency,
                _ratio(c.output_tokens_per_s_ratio),
                _ratio(c.ttft_p99_ratio),
                f"{c.texts_agree}/{c.texts_compared}",
            ]
            for c in comparisons
        ],
    )
    return [
        "",
        f"{FASTDECODE} / {LLAMA_CPP} (tok/s: > 1 is fastdecode faster; p99 TTFT: < 1 is fastdecode "
        "lower; equal greedy texts are informational, the two compute in different numerics):",
        "",
        table,
    ]


def render_markdown(report: ServeReport) -> str:
    lines = _header_lines(report)
    lines.append("")
    lines.append(_runs_table(report.runs))
    lines += _comparison_lines(report.comparisons)
    notes = list(report.notes) + ([f"stopped early: {report.stopped_early}"] if report.stopped_early else [])
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"
