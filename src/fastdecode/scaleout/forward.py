"""An HTTP request carried from the ingress to an engine replica, and the replica's app run on it.

Ray Serve's proxy hands a deployment the raw HTTP request, whose body a request router never
sees; fastdecode's ingress reads the body, so a :class:`ForwardedRequest` carries the prompt
along with the request itself, as ``prompt`` (the attribute Ray Serve LLM's
PrefixCacheAffinityRouter reads; here always one non-empty string of the request's text). The
replica answers with ASGI messages from its own FastAPI app (``fastdecode.server.app.create_app``),
so every route, error and stream is the single server's.

Written by hand because Ray Serve's handles carry Python objects, not ASGI: ``run_asgi`` is
the ASGI server side of one in-process call (httpx's ASGITransport would buffer a whole
stream before returning it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class ForwardedRequest:
    """One HTTP request: what an ASGI app needs, and the prompt for a prefix-aware router."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    # What a prefix router matches: the text of the chat's "messages" or of the completion's
    # "prompt"; the path for other requests. Never empty: Ray Serve LLM's router divides by its
    # length, and a request it cannot route waits forever.
    prompt: str = "/"

    @classmethod
    def from_http(
        cls, method: str, path: str, query_string: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> ForwardedRequest:
        """The request, with the text of its messages or prompt read from a JSON body (a bad body
        is routed on its path, and the replica's app answers it with its usual 400)."""
        try:
            obj = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            obj = None
        text = ""
        if isinstance(obj, dict):
            text = _text(obj.get("messages")) or _text(obj.get("prompt"))
        return cls(method, path, query_string, headers, body, text or path)


def _text(value) -> str:
    """The text of a prompt, a list of prompts, or messages (their contents, parts' "text" joined), as
    the PrefixCacheAffinityRouter reads them."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(v.get("content") if isinstance(v, dict) and "content" in v else v) for v in value)
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    return ""


def _scope(req: ForwardedRequest) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": "http",
        "path": req.path,
        "raw_path": req.path.encode("utf-8"),
        "query_string": req.query_string,
        "root_path": "",
        "headers": req.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }


async def run_asgi(app, req: ForwardedRequest) -> AsyncIterator[list[dict]]:
    """The ASGI messages ``app`` sends answering ``req``, in batches, as it sends them.

    A batch is every message sent since the previous batch, so under load a stream of tokens
    crosses the process boundary in fewer, larger items. The first batch holds
    ``http.response.start`` together with the first ``http.response.body``: whoever has it has
    the status, the headers and the first bytes at once, and a replica lost before it was sent
    had sent the client nothing (the relay can still send the request elsewhere). Closing the
    iterator early is the client going away: the app sees ``http.disconnect`` and is
    cancelled, so its requests are aborted."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    task = asyncio.create_task(app(_scope(req), receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        batch: list[dict] = []
        finished = False
        while not finished:
            batch.append(await queue.get())
            while not queue.empty():
                batch.append(queue.get_nowait())
            if batch[-1] is None:  # the app has returned (the done callback's mark comes last)
                finished = True
                batch.pop()
            if batch and (finished or any(m["type"] == "http.response.body" for m in batch)):
                yield batch
                batch = []
        await task  # an exception the app let through
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?(\s.*)$")


def merge_metrics(per_replica: list[tuple[str, str]]) -> str:
    """One Prometheus exposition from each replica's ``(replica, text)``: every sample gains a
    ``replica`` label, and each metric family is written once, its samples together (the text
    format requires it)."""
    families: dict[str, list[str]] = {}
    for replica, text in sorted(per_replica):
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                meta = families.setdefault(family, [])
                if line not in meta:
                    meta.append(line)
            elif line and not line.startswith("#"):
                m = _SAMPLE.match(line)
                if m is None:
                    continue
                labels = f'replica="{replica}"' + (f",{m.group(2)}" if m.group(2) else "")
                families.setdefault(family, []).append(f"{m.group(1)}{{{labels}}}{m.group(3)}")
    lines = [line for family in families.values() for line in family]
    return "\n".join(lines) + "\n"
