"""CPU seconds a server spends per generated token, counted over every process it runs.

A benchmark command (it prints figures, asserts nothing)::

    python -m fastdecode.scaleout.cpu_cost --requests 32 --concurrency 8 --max-tokens 64 -- \\
        fastdecode serve --weights gguf --drafter ngram --replicas 1 --replica-cpus 2 --port 8011

It starts the server command, waits for ``/health``, warms it up, then sums the user + system
CPU time of the server's process and all its descendants (Ray's GCS, raylet, Serve controller,
HTTP proxy and replicas: ``ray.init`` starts them under the driver) before and after a fixed
load of streamed chat requests on prompts not sent before, and prints the CPU milliseconds per
generated token for each kind of process. Unlike tokens per second on a shared machine, this
does not move when other work competes for the cores (busy-waiting threads aside), so the Ray
layer's cost can be compared with a single ``fastdecode serve`` anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict


def _kind(proc) -> str:
    """A process's kind: its Ray process title (``ray::ServeReplica:app:Deployment`` -> the
    deployment), else its program's name."""
    try:
        argv = proc.cmdline()
    except Exception:
        return "?"
    title = argv[0] if argv else proc.name()
    if title.startswith("ray::"):
        m = re.search(r"Fastdecode\w+", title) or re.search(r"ProxyActor|ServeController|IDLE|\w+Replica", title)
        return "ray:" + (m.group(0) if m else title[5:40])
    name = os.path.basename(title)
    if name.startswith("python"):
        rest = [a for a in argv[1:] if not a.startswith("-")]
        name = os.path.basename(rest[0]) if rest else name
        if "ray/" in " ".join(argv[1:3]):
            name = "ray:" + name
    return name


def cpu_by_kind(root_pid: int) -> dict[str, float]:
    """User + system CPU seconds of ``root_pid`` and every descendant, summed per kind."""
    import psutil

    root = psutil.Process(root_pid)
    totals: dict[str, float] = defaultdict(float)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            totals[_kind(proc)] += t.user + t.system
    return dict(totals)


async def _load(url: str, model: str, n: int, concurrency: int, max_tokens: int, offset: int) -> int:
    """Stream ``n`` chat requests, ``concurrency`` at a time; the completion tokens they reported."""
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": model,
            "messages": [
                {"role": "user", "content": f"Request {offset + i}: write a short story about the number {i}."}
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with sem, client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            tokens = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
            return tokens

    async with httpx.AsyncClient(timeout=600) as client:
        return sum(await asyncio.gather(*(one(client, i) for i in range(n))))


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> str:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8, help="requests sent before counting (default %(default)s)")
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the server command (it must take --port)")
    args = p.parse_args(argv)
    command = [a for a in args.command if a != "--"]
    port = command[command.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        model = _wait_ready(url, proc, args.start_timeout_s)
        asyncio.run(_load(url, model, args.warmup, args.concurrency, args.max_tokens, offset=10_000))
        time.sleep(2.0)  # let replicas settle (a health check, a metrics push) before counting
        before = cpu_by_kind(proc.pid)
        t0 = time.monotonic()
        tokens = asyncio.run(_load(url, model, args.requests, args.concurrency, args.max_tokens, offset=0))
        wall_s = time.monotonic() - t0
        after = cpu_by_kind(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    used = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = sum(used.values())
    print(f"{' '.join(command)}")
    print(f"{tokens} tokens in {args.requests} requests, {wall_s:.1f} s wall (not comparable on a shared machine)")
    print(f"{'process':<28} {'CPU s':>8} {'CPU ms/token':>13}")
    for kind, s in sorted(used.items(), key=lambda kv: -kv[1]):
        if s >= 0.005:
            print(f"{kind:<28} {s:8.2f} {1000 * s / max(tokens, 1):13.3f}")
    print(f"{'total':<28} {total:8.2f} {1000 * total / max(tokens, 1):13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
