"""Streamed responses: server-sent events in OpenAI's chunk format.

A stream sends, per choice, chunks as its tokens arrive (chat: first one chunk with
the assistant's role), each with a live ``fastdecode`` object (``tokens``,
``drafted``, ``accepted`` in that step; ``result`` once the choice finishes), then
the usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``.
An engine failure sends one error object in OpenAI's schema and ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from fastdecode.engine import RequestOutput
from fastdecode.server.engine_loop import Channel, EngineLoop, Failed
from fastdecode.server.protocol import APIError
from fastdecode.server.response import ResponseBuilder, choice_stats

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: done, the client gone
    (Starlette cancels the body, which may not even have started), or the server cancelling it."""

    def __init__(self, content, on_close: Callable[[], None], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _output_events(response: ResponseBuilder, item: RequestOutput, head: dict, usage_field: dict) -> list[str]:
    """The chunks for one output of the engine (none when it carries neither tokens nor a finish)."""
    delta = response.add(item)
    i = delta.index
    live = {"index": i, "tokens": len(item.token_ids), "drafted": item.num_drafted, "accepted": item.num_accepted}
    finish = response.finish[i]
    events = []
    if response.parsed.chat:
        if item.text or item.token_ids:
            choice = {"index": i, "delta": {"content": delta.text}, "finish_reason": None, "logprobs": delta.logprobs}
            events.append(sse({**head, "choices": [choice], **usage_field, "fastdecode": live}))
            live = {"index": i, "tokens": 0, "drafted": 0, "accepted": 0}  # counted once
        if finish is not None:
            live["result"] = choice_stats(item)
            choice = {"index": i, "delta": {}, "finish_reason": finish, "logprobs": None}
            events.append(sse({**head, "choices": [choice], **usage_field, "fastdecode": live}))
    elif delta.text or item.token_ids or finish is not None:
        if finish is not None:
            live["result"] = choice_stats(item)
        choice = {"index": i, "text": delta.text, "finish_reason": finish, "logprobs": delta.logprobs}
        events.append(sse({**head, "choices": [choice], **usage_field, "fastdecode": live}))
    return events


async def completion_events(response: ResponseBuilder, channel: Channel, engine_loop: EngineLoop) -> AsyncIterator[str]:
    """The stream's events as the request's outputs arrive on ``channel``."""
    chat = response.parsed.chat
    head = response.head("chat.completion.chunk" if chat else "text_completion")
    usage_field = {"usage": None} if response.parsed.include_usage else {}
    try:
        if chat:
            for i in range(len(response.index)):
                choice = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                    "logprobs": None,
                }
                yield sse({**head, "choices": [choice], **usage_field})
        failed = False
        while response.unfinished:
            item = await channel.get()
            if isinstance(item, Failed):
                yield sse(APIError(500, item.message, type="server_error").body())
                failed = True
                break
            for event in _output_events(response, item, head, usage_field):
                yield event
        if response.parsed.include_usage and not failed:
            yield sse({**head, "choices": [], "usage": response.usage(), "fastdecode": response.figures()})
        yield DONE
    finally:  # the client went away (or the server is cancelling): free the sequences' KV blocks
        engine_loop.abort(response.unfinished)  # (EventStream does it too, should this never have started)
