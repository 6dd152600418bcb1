"""A completion from request to response, shared by /v1/completions and /v1/chat/completions.

``generate`` parses the body, checks the model and the options, submits the
sequences to the engine thread, waits for them to be queued, then streams their
outputs (:mod:`~fastdecode.server.sse`) or collects them into one JSON body. A
client that goes away has its unfinished sequences aborted, so their KV blocks go
back to the pool at once.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fastdecode.decoding.tokenization import encode_messages, encode_prompt
from fastdecode.engine import GenerationConfig
from fastdecode.errors import FastDecodeError
from fastdecode.server.engine_loop import AddCommand, Channel, EngineLoop, Failed, Rejected
from fastdecode.server.errors import rejection_error, shutdown_error
from fastdecode.server.protocol import APIError, ParsedRequest, parse, read_json
from fastdecode.server.response import ResponseBuilder
from fastdecode.server.sse import EventStream, completion_events
from fastdecode.server.state import ServerState

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


def prompt_encoder(parsed: ParsedRequest) -> Callable[[object], list[list[int]]]:
    """The prompts' token ids, computed on the engine thread (see engine_loop)."""

    def encode(engine) -> list[list[int]]:
        if parsed.chat:
            return [encode_messages(engine.tokenizer, parsed.prompts[0])]
        ids = [encode_prompt(engine.tokenizer, p, engine.target.vocab_size, chat=False) for p in parsed.prompts]
        if parsed.echo:  # read by the response once the sequences are accepted
            for i, p in enumerate(parsed.prompts):
                if not isinstance(p, str):
                    parsed.echo_texts[i] = engine.tokenizer.decode(ids[i])
        return ids

    return encode


def check_model(name: str | None, model_name: str) -> None:
    if name is not None and name != model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )


def check_options(engine, parsed: ParsedRequest) -> None:
    """Errors in the options, at once (the engine thread checks the prompt)."""
    try:
        GenerationConfig.from_options(engine.config, **parsed.options[0])
    except FastDecodeError as exc:
        raise APIError(400, str(exc)) from None


async def submit(state: ServerState, parsed: ParsedRequest) -> tuple[ResponseBuilder, Channel]:
    """Queue the request's sequences on the engine thread; once queued, its response and its outputs' channel."""
    channel = Channel(asyncio.get_running_loop())
    request_ids = [f"{secrets.token_hex(8)}-{i}" for i in range(len(parsed.options))]
    state.engine_loop.submit(
        AddCommand(request_ids, prompt_encoder(parsed), parsed.prompt_index, parsed.options, channel)
    )
    try:
        first = await channel.get()
    except asyncio.CancelledError:
        state.engine_loop.abort(request_ids)
        raise
    if isinstance(first, Rejected):
        raise rejection_error(first.error, parsed.chat)
    return ResponseBuilder(parsed, first, state.model_name, replica=state.replica), channel


async def collect(request: Request, response: ResponseBuilder, channel: Channel, engine_loop: EngineLoop) -> Response:
    """Wait for every sequence to finish; the whole response (499 if the client went away first)."""
    clock = asyncio.get_running_loop().time
    next_check = clock() + DISCONNECT_POLL_S
    try:
        while response.unfinished:
            try:
                item = await asyncio.wait_for(channel.get(), max(0.0, next_check - clock()))
            except asyncio.TimeoutError:
                item = None
            if clock() >= next_check:
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it; the finally aborts
                next_check = clock() + DISCONNECT_POLL_S
            if item is None:
                continue
            if isinstance(item, Failed):
                raise APIError(500, item.message, type="server_error")
            response.add(item)
    finally:
        engine_loop.abort(response.unfinished)
    if "abort" in response.finish:  # only the server finishes a sequence as "abort": it is shutting down
        raise shutdown_error()
    return JSONResponse(response.body(), headers=response.headers())


async def generate(request: Request, state: ServerState, chat: bool) -> Response:
    """The response to a completion request (``chat``: /v1/chat/completions, else /v1/completions)."""
    parsed = parse(read_json(await request.body()), chat, state.default_max_tokens, state.limits.max_n)
    check_model(parsed.model, state.model_name)
    check_options(state.engine, parsed)
    response, channel = await submit(state, parsed)
    if parsed.stream:
        return EventStream(
            completion_events(response, channel, state.engine_loop),
            on_close=lambda: state.engine_loop.abort(response.unfinished),
            headers=response.headers(),
        )
    return await collect(request, response, channel, state.engine_loop)
