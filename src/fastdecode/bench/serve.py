"""``fastdecode bench-serve``: load on OpenAI-compatible HTTP servers, fastdecode's and llama.cpp's.

Each server is started as a subprocess on 127.0.0.1 (or one already running is given with
``--url``) and driven by a closed loop of streaming chat completions: for each concurrency C,
C clients each send their next request as soon as their last one ends (``vllm bench serve
--max-concurrency``), over the same prompts for every server, greedy. Reported per (server, C):

* aggregate output tokens/s = all output tokens of the run / its wall time; requests/s;
* TTFT: request sent -> first chunk that carries a token, p50 and p99;
* ITL, inter-token latency: the gaps between a response's successive token-bearing chunks,
  each gap spread evenly over the tokens its chunk carried (speculative decoding delivers
  several tokens per chunk: a chunk of 3 tokens 30 ms after the last counts as three 10 ms
  ITLs), p50 and p99. Per-chunk token counts come from fastdecode's ``fastdecode.tokens``
  chunk field where present; otherwise a response's tokens are spread evenly over its chunks;
* TPOT, time per output token after the first: mean of (e2e - TTFT) / (tokens - 1);
* errors (HTTP or stream errors, timeouts).

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
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fastdecode._cli_util import check_output_dir, int_list, run_main, staged_dir
from fastdecode.bench.throughput import percentile
from fastdecode.errors import ConfigError
from fastdecode.registry import Registry

FASTDECODE, LLAMA_CPP, URL = "fastdecode", "llama-cpp", "url"
WARMUP_TOKENS = 8
STOP_TIMEOUT_S = 20.0  # after SIGTERM, before SIGKILL
LOG_TAIL_LINES = 12
SERVE_WEIGHTS = ("float", "int8", "int4", "q8_0", "q4_0", "q4_1", "gguf")  # `fastdecode serve --weights`


class TimeLimitReached(Exception):
    """``--time-limit-s`` ran out: stop, and report what was measured."""


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


def summarize(server: str, concurrency: int, num_requests: int, records: Sequence[RequestRecord], wall_s: float,
              complete: bool = True) -> ServeRun:
    """One (server, C) run's figures from its finished requests."""
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    tokens = sum(r.output_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in inter_token_latencies(r.chunk_times_s, tokens_per_chunk(r))]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
             if r.ttft_s is not None and r.output_tokens and r.output_tokens > 1]
    return ServeRun(
        server=server, concurrency=concurrency, num_requests=num_requests, completed=len(ok), errors=len(failed),
        cancelled=num_requests - len(records), output_tokens=tokens, wall_s=wall_s,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50), itl_p99_s=percentile(itls, 99),
        tpot_mean_s=sum(tpots) / len(tpots) if tpots else 0.0,
        tokens_counted_by=", ".join(sorted({r.tokens_counted_by for r in ok})) or "-",
        complete=complete, first_error=failed[0].error if failed else None,
    )


def compare(runs: Sequence[ServeRun], records: Sequence[RequestRecord], ours: str = FASTDECODE,
            peer: str = LLAMA_CPP) -> list[Comparison]:
    """``ours`` / ``peer`` at every concurrency both ran; a ratio is None where the peer's figure is 0."""
    by_key = {(r.server, r.concurrency): r for r in runs}
    texts = {(r.server, r.concurrency, r.prompt_index): r.text for r in records if r.error is None}
    out = []
    for c in sorted({r.concurrency for r in runs}):
        a, b = by_key.get((ours, c)), by_key.get((peer, c))
        if a is None or b is None:
            continue
        pairs = [(text, texts[(peer, c, i)]) for (s, cc, i), text in texts.items()
                 if s == ours and cc == c and (peer, c, i) in texts]
        out.append(Comparison(
            concurrency=c,
            output_tokens_per_s_ratio=a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else None,
            ttft_p99_ratio=a.ttft_p99_s / b.ttft_p99_s if b.ttft_p99_s else None,
            texts_agree=sum(x == y for x, y in pairs), texts_compared=len(pairs),
        ))
    return out


# ---------------------------------------------------------------- the servers

@dataclass(frozen=True)
class ServerKind:
    """A server this command can start: how, how to tell it is ready, what to add to every request."""

    name: str
    ready_path: str  # GET it until 200
    unavailable: Callable[[argparse.Namespace], str | None]  # why it cannot run here, or None
    command: Callable[[argparse.Namespace, int], list[str]]  # (args, port) -> argv
    extra_body: dict[str, Any] = field(default_factory=dict)


SERVERS: Registry[str, ServerKind] = Registry("server")


def _fastdecode_command(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "fastdecode.cli", "serve", "--model", args.model, "--weights", args.weights,
            "--drafter", args.drafter, "--max-num-seqs", str(max(args.concurrency)), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--shutdown-timeout", "5", *shlex.split(args.serve_args)]


def _gguf_path(spec: str) -> str | None:
    from fastdecode.errors import FastDecodeError
    from fastdecode.loading import resolve_spec

    with contextlib.suppress(FastDecodeError):
        source = resolve_spec(spec)
        if source.kind == "gguf":
            return source.location
    return None


def _llama_cpp_unavailable(args: argparse.Namespace) -> str | None:
    # The server's extras, looked up without importing llama_cpp (that loads its shared library).
    missing = [m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn", "fastapi")
               if importlib.util.find_spec(m) is None]
    if missing:
        return f"llama-cpp-python[server] is not installed (missing {', '.join(missing)}; see scripts/setup_peer.sh)"
    if _gguf_path(args.model) is None:
        return f"{args.model} is not a GGUF model"
    return None


def _llama_cpp_command(args: argparse.Namespace, port: int) -> list[str]:
    # interrupt_requests defaults to True: a request arriving while another streams would end that
    # stream early ([DONE] mid-answer), which under concurrent load truncates nearly every response.
    return [sys.executable, "-m", "llama_cpp.server", "--model", _gguf_path(args.model), "--n_threads",
            str(os.cpu_count() or 1), "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port),
            "--interrupt_requests", "false"]


SERVERS.register(FASTDECODE)(ServerKind(FASTDECODE, "/health", lambda args: None, _fastdecode_command))
# The server's repeat_penalty defaults to 1.1, which changes even greedy output; 1.0 is plain greedy.
SERVERS.register(LLAMA_CPP)(ServerKind(LLAMA_CPP, "/v1/models", _llama_cpp_unavailable, _llama_cpp_command,
                                       extra_body={"repeat_penalty": 1.0}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    last = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n  | ".join(["", *last]) if last else " (it printed nothing)"


class ServerProcess:
    """A server subprocess; its stdout and stderr go to ``log_path`` (a pipe could fill and stall it)."""

    def __init__(self, kind: ServerKind, argv: list[str], port: int, log_path: Path) -> None:
        self.kind, self.argv, self.log_path = kind, argv, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")
        # Its own session: Ctrl-C reaches only this command, which then stops the server itself.
        # Without FASTDECODE_API_KEY: `fastdecode serve` would take it as its key and refuse our requests.
        env = {k: v for k, v in os.environ.items() if k != "FASTDECODE_API_KEY"}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float, deadline: float) -> None:
        """Poll ``kind.ready_path`` until 200. ConfigError (with its log's last lines) if the process
        exits or ``timeout_s`` passes; TimeLimitReached at ``deadline`` (monotonic)."""
        import httpx

        give_up = min(time.monotonic() + timeout_s, deadline)
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ConfigError(f"the {self.kind.name} server exited (status {code}) before it was ready; "
                                  f"its last lines:{_tail(self.log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + self.kind.ready_path, timeout=2).status_code == 200:
                    return
            if time.monotonic() >= give_up:
                if give_up >= deadline:
                    raise TimeLimitReached(f"while the {self.kind.name} server was starting")
                raise ConfigError(f"the {self.kind.name} server was not ready within {timeout_s:.0f} s "
                                  f"(--start-timeout-s); its last lines:{_tail(self.log_path)}")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------- the client

@dataclass(frozen=True)
class Endpoint:
    """Where to send requests and what every request carries."""

    url: str  # http://host:port, without /v1
    model_id: str
    chat: bool  # /v1/chat/completions with one user message, else /v1/completions with the raw prompt
    max_new_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)

    def request(self, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model_id, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                                "stream_options": {"include_usage": True}, **self.extra_body}
        if self.chat:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace").strip()[:300]
    return f"HTTP {status}: {message}"


async def stream_request(client, endpoint: Endpoint, prompt: str, max_tokens: int, timeout_s: float,
                         server: str = "", concurrency: int = 0, prompt_index: int = 0) -> RequestRecord:
    """Send one streaming request and time its chunks. Failures become ``record.error``, never raise."""
    path, body = endpoint.request(prompt, max_tokens)
    times: list[float] = []
    counts: list[int] = []  # fastdecode's per-chunk token counts, one per token-bearing chunk when given
    pieces: list[str] = []
    usage_tokens: int | None = None
    finish: str | None = None
    error: str | None = None
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", endpoint.url + path, json=body, headers=endpoint.headers) as response:
                if response.status_code != 200:
                    error = _error_text(response.status_code, await response.aread())
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, pings
                        data = line[len("data:"):].strip()
                        if data == "[DONE]":
                            break
                        now = time.perf_counter() - t0
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                            break
                        if chunk.get("usage"):
                            usage_tokens = chunk["usage"].get("completion_tokens")
                        for choice in chunk.get("choices") or []:
                            text = (choice.get("delta") or {}).get("content") if endpoint.chat else choice.get("text")
                            n = (chunk.get("fastdecode") or {}).get("tokens")
                            # A fastdecode chunk may carry tokens whose text the detokenizer still holds back.
                            if text or n:
                                times.append(now)
                                pieces.append(text or "")
                                if n is not None:
                                    counts.append(n)
                            finish = choice.get("finish_reason") or finish
    except TimeoutError:
        error = f"timed out after {timeout_s:g} s"
    except Exception as exc:  # transport errors, malformed SSE: this request failed, the run goes on
        error = f"{type(exc).__name__}: {exc}"
    e2e = time.perf_counter() - t0
    if error is None and finish is None:
        # [DONE] (or the connection's end) before any finish_reason: the server cut the response off,
        # as llama-cpp-python's server does to a stream when another request arrives (interrupt_requests).
        error = "the stream ended without a finish_reason"
    chunk_tokens = counts if counts and len(counts) == len(times) else None
    if usage_tokens is not None:
        output_tokens, counted_by = usage_tokens, "usage"
    elif chunk_tokens is not None:
        output_tokens, counted_by = sum(chunk_tokens), "server chunks"
    elif finish == "length":
        output_tokens, counted_by = max_tokens, "length"
    else:
        output_tokens, counted_by = None, "tokenizer"  # filled in after the run (see count_missing_tokens)
    return RequestRecord(server=server, concurrency=concurrency, prompt_index=prompt_index,
                         ttft_s=times[0] if times else None, e2e_s=e2e, chunk_times_s=times,
                         chunk_tokens=chunk_tokens, output_tokens=output_tokens, tokens_counted_by=counted_by,
                         finish_reason=finish, text="".join(pieces), error=error)


def _client(concurrency: int, timeout_s: float):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))


async def closed_loop(endpoint: Endpoint, prompts: Sequence[str], concurrency: int, request_timeout_s: float,
                      deadline: float, server: str = "") -> tuple[list[RequestRecord], float, bool]:
    """``concurrency`` workers take prompts from one queue, each sending its next request when the last
    ends. Returns (records in prompt order, wall seconds, complete); at ``deadline`` (monotonic) the
    requests in flight are cancelled and complete is False."""
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    records: list[RequestRecord] = []
    async with _client(concurrency, request_timeout_s) as client:
        async def worker() -> None:
            while not queue.empty():
                i, prompt = queue.get_nowait()
                records.append(await stream_request(client, endpoint, prompt, endpoint.max_new_tokens,
                                                    request_timeout_s, server, concurrency, i))

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.prompt_index), wall_s, not pending


async def _one(endpoint: Endpoint, prompt: str, max_tokens: int, timeout_s: float) -> RequestRecord:
    async with _client(1, timeout_s) as client:
        return await stream_request(client, endpoint, prompt, max_tokens, timeout_s)


def model_card(url: str, headers: dict[str, str], timeout_s: float = 10.0) -> dict[str, Any]:
    """The first entry of GET /v1/models; ConfigError when the server cannot be reached or refuses."""
    import httpx

    try:
        response = httpx.get(url + "/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    if response.status_code == 401:
        raise ConfigError(f"{url}/v1/models: HTTP 401 (give the server's key with --api-key)")
    if response.status_code != 200:
        raise ConfigError(f"{url}/v1/models: HTTP {response.status_code}; is it an OpenAI-compatible server?")
    try:
        return response.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"{url}/v1/models: no model listed") from None


# ---------------------------------------------------------------- output tokens without usage

class TokenCounter:
    """Counts output tokens with the model's tokenizer, loaded on first use (never during a run)."""

    def __init__(self, spec: str | None) -> None:
        self.spec = spec
        self._tokenizer = None
        self.failed: str | None = None

    def count(self, text: str) -> int | None:
        if self._tokenizer is None and self.failed is None:
            try:
                self._tokenizer = _load_tokenizer(self.spec)
            except Exception as exc:  # any loader failure: fall back to counting chunks, and say so
                self.failed = f"{type(exc).__name__}: {exc}"
        if self._tokenizer is None:
            return None
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def _load_tokenizer(spec: str | None):
    from transformers import AutoTokenizer

    from fastdecode.loading import _gguf_cache_dir, resolve_spec

    if spec is None:
        raise ConfigError("no --model to take a tokenizer from")
    source = resolve_spec(spec)
    if source.kind == "gguf":
        cached = _gguf_cache_dir(source.location)  # fastdecode's converted copy, when a load made one
        if cached is not None and (cached / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(str(cached))
        return AutoTokenizer.from_pretrained(str(Path(source.location).parent), gguf_file=Path(source.location).name)
    return AutoTokenizer.from_pretrained(source.location)


def count_missing_tokens(records: Sequence[RequestRecord], counter: TokenCounter) -> None:
    """Fill ``output_tokens`` where the server sent no count: the tokenizer's count of the text, else
    (no tokenizer) the number of token-bearing chunks."""
    for r in records:
        if r.output_tokens is None:
            n = counter.count(r.text) if r.text else 0
            if n is None:
                r.output_tokens, r.tokens_counted_by = len(r.chunk_times_s), "chunks"
            else:
                r.output_tokens = n


# ---------------------------------------------------------------- rendering

def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def run_line(run: ServeRun) -> str:
    cut = "" if run.complete else "  (cut by --time-limit-s)"
    errors = f"  {run.errors} errors" if run.errors else ""
    return (f"{run.server:10} C={run.concurrency:<3} {run.output_tokens_per_s:7.1f} tok/s  {run.requests_per_s:5.2f} req/s  "
            f"TTFT p50 {_ms(run.ttft_p50_s):>5} p99 {_ms(run.ttft_p99_s):>5} ms  ITL p50 {_ms(run.itl_p50_s):>5} "
            f"p99 {_ms(run.itl_p99_s):>5} ms  TPOT {_ms(run.tpot_mean_s):>5} ms{errors}{cut}")


def render_markdown(report: ServeReport) -> str:
    from fastdecode.bench.report import cpu_line, md_table

    m, s = report.machine, report.settings
    lines = [
        "# fastdecode bench-serve", "",
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
    lines.append("")
    rows = [[r.server, r.concurrency, f"{r.completed}/{r.num_requests}", r.errors, f"{r.output_tokens_per_s:.1f}",
             f"{r.requests_per_s:.2f}", _ms(r.ttft_p50_s), _ms(r.ttft_p99_s), _ms(r.itl_p50_s), _ms(r.itl_p99_s),
             _ms(r.tpot_mean_s), r.tokens_counted_by + ("" if r.complete else " (cut short)")] for r in report.runs]
    lines.append(md_table(["server", "C", "done", "errors", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
                           "ITL p50 ms", "ITL p99 ms", "TPOT ms", "tokens counted by"], rows))
    if report.comparisons:
        lines += ["", f"{FASTDECODE} / {LLAMA_CPP} (tok/s: > 1 is fastdecode faster; p99 TTFT: < 1 is fastdecode "
                      "lower; equal greedy texts are informational, the two compute in different numerics):", ""]
        lines.append(md_table(["C", "output tok/s ratio", "p99 TTFT ratio", "greedy texts equal"],
                              [[c.concurrency, _ratio(c.output_tokens_per_s_ratio), _ratio(c.ttft_p99_ratio),
                                f"{c.texts_agree}/{c.texts_compared}"] for c in report.comparisons]))
    notes = list(report.notes) + ([f"stopped early: {report.stopped_early}"] if report.stopped_early else [])
    if notes:
        lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the command

def add_bench_serve_parser(subparsers) -> argparse.ArgumentParser:
    from fastdecode.drafters import available_drafters
    from fastdecode.loading import DEFAULT_MODEL

    p = subparsers.add_parser(
        "bench-serve", help="load on OpenAI-compatible servers: throughput, TTFT, ITL at several concurrencies",
        description=" ".join(__doc__.split("\n\n")[1].split()),
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="model spec; llama-cpp needs a GGUF file (default: %(default)s)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--servers", default=f"{FASTDECODE},{LLAMA_CPP}",
                       help=f"comma list of servers to start: {FASTDECODE}, {LLAMA_CPP} (default: %(default)s)")
    where.add_argument("--url", default=None, help="benchmark the server already running here instead (http://host:port)")
    p.add_argument("--api-key", default=None, help="with --url: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--weights", default="float", choices=SERVE_WEIGHTS, help="fastdecode serve --weights (default: %(default)s)")
    p.add_argument("--drafter", default="ngram", choices=["none", *available_drafters()],
                   help="fastdecode serve --drafter (default: %(default)s)")
    p.add_argument("--serve-args", default="", help="more options for `fastdecode serve`, one shell-quoted string")
    p.add_argument("--concurrency", type=int_list, default=(1, 4, 8, 16), help="comma list (default: 1,4,8,16)")
    p.add_argument("--num-requests", type=int, default=None, help="requests per run (default: 2*C, at least 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens per request (default: %(default)s)")
    p.add_argument("--datasets", default="suite,humaneval", help="prompt sets, taken in turn (default: %(default)s)")
    p.add_argument("--prompts-file", default=None, help='JSONL file, one {"prompt": ...} per line (instead of --datasets)')
    p.add_argument("--no-chat", action="store_true", help="send raw prompts to /v1/completions instead of chat")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="per request (default: %(default)s)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="for a server to become ready (default: %(default)s)")
    p.add_argument("--time-limit-s", type=float, default=1800.0,
                   help="for the whole command; when reached it stops and reports what was measured (default: %(default)s)")
    p.add_argument("--out", default=None, help="directory for results.json, results.md and the servers' logs")
    p.set_defaults(func=cmd_bench_serve)
    return p


def _check_args(args: argparse.Namespace) -> list[str]:
    """Validate the options; returns the server names to run."""
    for name, value in (("--num-requests", args.num_requests), ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    for name, value in (("--request-timeout-s", args.request_timeout_s), ("--start-timeout-s", args.start_timeout_s),
                        ("--time-limit-s", args.time_limit_s)):
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


def _measure_server(name: str, endpoint: Endpoint, args: argparse.Namespace, prompts: Sequence[str],
                    requests_per_c: dict[int, int], deadline: float, report: ServeReport, counter: TokenCounter) -> None:
    """The warm-up request, then one closed-loop run per concurrency; raises TimeLimitReached."""
    timeout_s = max(0.1, min(args.request_timeout_s, deadline - time.monotonic()))
    warm = asyncio.run(_one(endpoint, prompts[0], min(WARMUP_TOKENS, args.max_new_tokens), timeout_s))
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
            closed_loop(endpoint, prompts[:n], c, args.request_timeout_s, deadline, server=name))
        count_missing_tokens(records, counter)
        run = summarize(name, c, n, records, wall_s, complete)
        report.runs.append(run)
        report.requests.extend(records)
        print(run_line(run), flush=True)
        if not complete:
            raise TimeLimitReached(f"during {name} C={c}")


def _start_and_measure(name: str, args: argparse.Namespace, prompts: Sequence[str], requests_per_c: dict[int, int],
                       deadline: float, report: ServeReport, counter: TokenCounter, logs: Path) -> None:
    """Start server ``name`` (or note why it is skipped), measure it, stop it."""
    kind = SERVERS.get(name)
    why = kind.unavailable(args)
    if why:
        print(f"fastdecode: note: skipping the {name} server: {why}", file=sys.stderr)
        report.servers[name] = {"skipped": why}
        return
    port = free_port()
    argv = kind.command(args, port)
    info: dict[str, Any] = {"command": shlex.join(["python", *argv[1:]]),
                            "version": _version("llama_cpp_python") if name == LLAMA_CPP else None}
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


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from fastdecode.bench.report import machine_description
    from fastdecode.bench.throughput import _prompts

    start = time.monotonic()
    deadline = start + args.time_limit_s
    names = _check_args(args)
    if args.out:
        check_output_dir(args.out, "bench-serve results", allow_nonempty_if=lambda p: (p / "results.json").exists())
    requests_per_c = {c: args.num_requests or max(2 * c, 8) for c in args.concurrency}
    prompts, source = _prompts([d.strip() for d in args.datasets.split(",") if d.strip()],
                               max(requests_per_c.values()), args.prompts_file)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.url is not None:
        url = args.url.rstrip("/").removesuffix("/v1")
        card = model_card(url, headers)  # ConfigError when unreachable, before any work
    settings = {"model": args.model, "servers": names, "url": args.url, "weights": args.weights,
                "drafter": args.drafter, "serve_args": args.serve_args, "concurrency": list(args.concurrency),
                "num_requests": {str(c): n for c, n in requests_per_c.items()}, "max_new_tokens": args.max_new_tokens,
                "prompts": source, "chat": not args.no_chat, "request_timeout_s": args.request_timeout_s,
                "time_limit_s": args.time_limit_s}
    report = ServeReport(machine_description(), settings)
    counter = TokenCounter(args.model)
    chat = not args.no_chat
    failures: list[str] = []  # a server that would not start or answer: reported after the others ran
    with tempfile.TemporaryDirectory(prefix="fastdecode-bench-serve-") as logs:
        try:
            if args.url is not None:
                report.servers[URL] = {"command": f"(already running at {url})", "model_card": card}
                endpoint = Endpoint(url, card["id"], chat, args.max_new_tokens, headers)
                _measure_server(URL, endpoint, args, prompts, requests_per_c, deadline, report, counter)
            else:
                for name in names:
                    try:
                        _start_and_measure(name, args, prompts, requests_per_c, deadline, report, counter, Path(logs))
                    except ConfigError as exc:
                        failures.append(str(exc))
                        report.servers.setdefault(name, {})["failed"] = str(exc)
                        print(f"fastdecode: note: the {name} server failed (the error follows at the end)",
                              file=sys.stderr, flush=True)
        except TimeLimitReached as exc:
            report.stopped_early = f"--time-limit-s {args.time_limit_s:g} reached {exc}"
            print(f"fastdecode: note: {report.stopped_early}; reporting what was measured", file=sys.stderr)
        report.comparisons = compare(report.runs, report.requests)
        if counter.failed:
            report.notes.append(f"no tokenizer for counting output tokens ({counter.failed}): chunks counted instead")
        if any(r.tokens_counted_by == "tokenizer" for r in report.requests):
            report.notes.append("some servers sent no usage counts: those outputs were counted with the model's "
                                "tokenizer (re-tokenized text; max_tokens for responses that stopped for length)")
        text = render_markdown(report)
        print("\n" + text)
        if args.out:
            with staged_dir(args.out, marker="results.json") as out:
                (out / "results.md").write_text(text)
                for log in Path(logs).iterdir():
                    (out / log.name).write_bytes(log.read_bytes())
                (out / "results.json").write_text(json.dumps(
                    {"machine": report.machine, "settings": settings, "servers": report.servers,
                     "runs": [asdict(r) for r in report.runs], "comparisons": [asdict(c) for c in report.comparisons],
                     "notes": report.notes, "stopped_early": report.stopped_early,
                     "requests": [asdict(r) for r in report.requests]}, indent=1))
    if failures:
        raise ConfigError(failures[0] if len(failures) == 1 else f"{len(failures)} servers failed: " + "; ".join(failures))
    if any(r.errors for r in report.runs):
        print("fastdecode: warning: some requests failed (see the errors column)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastdecode")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_main(parser, argv)
