"""``fastdecode bench-serve``'s client: streaming chat or text completions timed chunk by chunk,
a closed loop of them, and the output tokens of a server that sends no counts."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.bench.serve_results import RequestRecord
from fastdecode.errors import ConfigError


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
        body: dict[str, Any] = {
            "model": self.model_id,
            "stream": True,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        if self.chat:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", errors="replace").strip()[:300]
    return f"HTTP {status}: {message}"


@dataclass
class _Stream:
    """What one response's chunks said so far."""

    chat: bool
    times: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk
    counts: list[int] = field(default_factory=list)  # fastdecode's per-chunk token counts, when given
    pieces: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it
    finish: str | None = None
    error: str | None = None

    def add(self, chunk: dict[str, Any], now: float) -> bool:
        """Take one SSE chunk that arrived at ``now``; False when it ends the stream (an error)."""
        if "error" in chunk:
            self.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
            return False
        if chunk.get("usage"):
            usage = chunk["usage"]
            self.usage_tokens = usage.get("completion_tokens")
            self.prompt_tokens = usage.get("prompt_tokens")
            self.cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            n = (chunk.get("fastdecode") or {}).get("tokens")
            # A fastdecode chunk may carry tokens whose text the detokenizer still holds back.
            if text or n:
                self.times.append(now)
                self.pieces.append(text or "")
                if n is not None:
                    self.counts.append(n)
            self.finish = choice.get("finish_reason") or self.finish
        return True

    async def read(self, response, t0: float) -> None:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, pings
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter() - t0
            if not self.add(json.loads(data), now):
                break

    def output_tokens(self, max_tokens: int) -> tuple[list[int] | None, int | None, str]:
        """(tokens per chunk when the server counted every chunk, output tokens, where that count came from)."""
        chunk_tokens = self.counts if self.counts and len(self.counts) == len(self.times) else None
        if self.usage_tokens is not None:
            return chunk_tokens, self.usage_tokens, "usage"
        if chunk_tokens is not None:
            return chunk_tokens, sum(chunk_tokens), "server chunks"
        if self.finish == "length":
            return chunk_tokens, max_tokens, "length"
        return chunk_tokens, None, "tokenizer"  # filled in after the run (see count_missing_tokens)


async def stream_request(
    client,
    endpoint: Endpoint,
    prompt: str,
    max_tokens: int,
    timeout_s: float,
    server: str = "",
    concurrency: int = 0,
    prompt_index: int = 0,
) -> RequestRecord:
    """Send one streaming request and time its chunks. Failures become ``record.error``, never raise."""
    path, body = endpoint.request(prompt, max_tokens)
    stream = _Stream(endpoint.chat)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", endpoint.url + path, json=body, headers=endpoint.headers) as response:
                if response.status_code != 200:
                    stream.error = _error_text(response.status_code, await response.aread())
                else:
                    await stream.read(response, t0)
    except TimeoutError:
        stream.error = f"timed out after {timeout_s:g} s"
    except Exception as exc:  # transport errors, malformed SSE: this request failed, the run goes on
        stream.error = f"{type(exc).__name__}: {exc}"
    e2e = time.perf_counter() - t0
    if stream.error is None and stream.finish is None:
        # [DONE] (or the connection's end) before any finish_reason: the server cut the response off,
        # as llama-cpp-python's server does to a stream when another request arrives (interrupt_requests).
        stream.error = "the stream ended without a finish_reason"
    chunk_tokens, output_tokens, counted_by = stream.output_tokens(max_tokens)
    return RequestRecord(
        server=server,
        concurrency=concurrency,
        prompt_index=prompt_index,
        ttft_s=stream.times[0] if stream.times else None,
        e2e_s=e2e,
        chunk_times_s=stream.times,
        chunk_tokens=chunk_tokens,
        output_tokens=output_tokens,
        tokens_counted_by=counted_by,
        finish_reason=stream.finish,
        text="".join(stream.pieces),
        error=stream.error,
        prompt_tokens=stream.prompt_tokens,
        cached_prompt_tokens=stream.cached_prompt_tokens,
    )


def _client(concurrency: int, timeout_s: float):
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )


async def closed_loop(
    endpoint: Endpoint,
    prompts: Sequence[str],
    concurrency: int,
    request_timeout_s: float,
    deadline: float,
    server: str = "",
    first_index: int = 0,
) -> tuple[list[RequestRecord], float, bool]:
    """``concurrency`` workers take prompts from one queue, each sending its next request when the last
    ends. Returns (records in prompt order, wall seconds, complete); at ``deadline`` (monotonic) the
    requests in flight are cancelled and complete is False. ``first_index``: the first prompt's
    index in the whole benchmark's list (records carry it)."""
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(prompts, first_index):
        queue.put_nowait(item)
    records: list[RequestRecord] = []
    async with _client(concurrency, request_timeout_s) as client:

        async def worker() -> None:
            while not queue.empty():
                i, prompt = queue.get_nowait()
                records.append(
                    await stream_request(
                        client, endpoint, prompt, endpoint.max_new_tokens, request_timeout_s, server, concurrency, i
                    )
                )

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.prompt_index), wall_s, not pending


async def one_request(endpoint: Endpoint, prompt: str, max_tokens: int, timeout_s: float) -> RequestRecord:
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
