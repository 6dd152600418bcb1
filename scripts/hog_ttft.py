"""Time to first token of ordinary clients beside the hog of issue 42, against a running server.

The hog: ``{"prompt": "Once upon a time", "max_tokens": 1000000000, "min_tokens": 8000, "n": 3,
"stream": true}`` on ``/v1/completions`` (with a seed, so that its tokens can be compared with a run
of it alone). Each round, ``--clients`` clients send one streaming chat request each at once
(``--max-tokens`` new tokens, greedy), and the time from sending to the first content chunk is each
one's TTFT; ``--hog`` starts the hog first, and before each round waits until each of its
sequences has streamed ``--head-start-tokens`` more chunks (the hog decoding, as when it holds its
slots: a round sent the moment the last one ends would find the hog just readmitted, and its 3 extra
clients would wait up to ``--time-slice-tokens`` of the hog's tokens). Prints p50 / p99 / max TTFT
over every client of every round and whether all finished; with ``--check-hog``, the hog's texts
against a run of it alone afterwards (the server otherwise idle).

Start a server, then run without and with the hog and compare the p99s:

    fastdecode serve --model smollm2-135m --max-num-seqs 8 --port 8000 &
    PYTHONPATH=src python scripts/hog_ttft.py --url http://127.0.0.1:8000 --rounds 5
    PYTHONPATH=src python scripts/hog_ttft.py --url http://127.0.0.1:8000 --rounds 5 --hog --check-hog
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

HOG = {"prompt": "Once upon a time", "max_tokens": 1_000_000_000, "min_tokens": 8000, "n": 3, "seed": 7}
TOPICS = ("cats", "dogs", "the sea", "rain", "bread", "trains", "stars", "snow", "tea", "clocks", "maps", "owls")


async def _sse_lines(response: httpx.Response):
    """The stream's lines split at "\n" only: httpx's ``aiter_lines`` also splits at U+2028 and the other
    separators ``str.splitlines`` knows, which a JSON string may hold unescaped (a token's text)."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if pending:
        yield pending


async def _hog(client: httpx.AsyncClient, chunks: list[int]) -> list[str]:
    """Stream the hog, counting each sequence's chunks in ``chunks``; its three texts."""
    texts = ["", "", ""]
    async with client.stream("POST", "/v1/completions", json={**HOG, "stream": True}) as r:
        r.raise_for_status()
        print(f"hog: {r.headers.get('X-Fastdecode-Clamped', 'not clamped')}", flush=True)
        async for line in _sse_lines(r):
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
                    chunks[choice["index"]] += 1
    return texts


async def _head_start(hog: asyncio.Task, chunks: list[int], tokens: int) -> None:
    """Wait until each hog sequence has streamed ``tokens`` more chunks (or the hog has ended)."""
    target = min(chunks) + tokens
    while min(chunks) < target and not hog.done():
        await asyncio.sleep(0.02)


async def _client(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[float | None, bool]:
    body = {
        "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0, ttft, finished = time.perf_counter(), None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in _sse_lines(r):
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if ttft is None and choice.get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
            finished = finished or choice.get("finish_reason") is not None
    return ttft, finished


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]  # nearest rank


async def main(args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s, headers=headers) as client:
        hog_task, chunks = None, [0, 0, 0]
        if args.hog:
            hog_task = asyncio.create_task(_hog(client, chunks))
        ttfts, all_finished = [], True
        for _ in range(args.rounds):
            if hog_task is not None:  # the hog decoding again since the last round, as when it holds its slots
                await _head_start(hog_task, chunks, args.head_start_tokens)
            results = await asyncio.gather(*(_client(client, i, args.max_tokens) for i in range(args.clients)))
            ttfts += [t for t, _ in results if t is not None]
            all_finished = all_finished and all(f and t is not None for t, f in results)
        if hog_task is not None and hog_task.done():
            print("the hog ended before the last round: lower --rounds or --head-start-tokens", flush=True)
        print(
            f"{'with' if args.hog else 'without'} the hog: {len(ttfts)} clients, all finished: {all_finished}; "
            f"TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, p99 {_percentile(ttfts, 0.99) * 1e3:.0f} ms, "
            f"max {max(ttfts) * 1e3:.0f} ms",
            flush=True,
        )
        if hog_task is None:
            return
        hog = await hog_task
        print(f"hog finished: {[len(t) for t in hog]} characters", flush=True)
        if args.check_hog:
            r = await client.post("/v1/completions", json={**HOG, "stream": False})
            r.raise_for_status()
            alone = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            print(f"hog identical to it alone: {hog == alone}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hog", action="store_true", help="run the hog of issue 42 beside the clients")
    parser.add_argument("--head-start-tokens", type=int, default=64, help="hog chunks per sequence before each round")
    parser.add_argument("--check-hog", action="store_true", help="compare the hog with a run of it alone")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    asyncio.run(main(parser.parse_args()))
