"""The HTTP layer: an OpenAI-compatible FastAPI app over an :class:`~fastdecode.engine.Engine`.

``create_app(engine, model_name=...)`` takes an engine that is already built
(the CLI loads a model; tests pass a tiny one). Its lifespan starts the
:class:`~fastdecode.server.engine_loop.EngineLoop` thread and, at shutdown,
lets running requests finish for up to ``shutdown_timeout_s`` before
aborting the rest.

A response's ``fastdecode`` object carries the speculation figures
(conventions in ``fastdecode.metrics``: tau counts the bonus token, and plain
decoding has tau 1). Engine finish reasons map to OpenAI's: eos and stop
strings -> "stop", max tokens and the context length -> "length"; "abort"
appears only for requests the server aborted while shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdecode.engine import GenerationConfig
from fastdecode.errors import ConfigError, FastDecodeError, PromptTooLongError
from fastdecode.request import RequestOutput
from fastdecode.server.engine_loop import Accepted, AddCommand, Channel, EngineLoop, Failed, Rejected, ServerBusyError
from fastdecode.server.metrics import FINISH_REASONS, ServerMetrics
from fastdecode.server.protocol import APIError, ParsedRequest, parse, read_json

logger = logging.getLogger("fastdecode.server")

STATIC_DIR = resources.files("fastdecode.server") / "static"
RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


def _encoder(parsed: ParsedRequest):
    """The prompts' token ids, computed on the engine thread (see engine_loop)."""

    def encode(engine) -> list[list[int]]:
        if not parsed.chat:
            return [engine.encode(p, chat=False) for p in parsed.prompts]
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this model has no chat template: use /v1/completions with raw text")
        try:
            text = tokenizer.apply_chat_template(parsed.prompts[0], tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (alternating roles, ...) raise
            raise ConfigError(f"the model's chat template refused these messages: {exc}") from None
        return [tokenizer(text, add_special_tokens=False)["input_ids"]]

    return encode


class _EventStream(StreamingResponse):
    """Server-sent events that call ``on_close`` however the response ends: done, the client gone
    (Starlette cancels the body, which may not even have started), or the server cancelling it."""

    def __init__(self, content, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _choice_stats(out: RequestOutput) -> dict | None:
    """One finished sequence's figures (None for one the server aborted)."""
    result = out.result
    if result is None:
        return None
    a = result.acceptance
    return {
        "drafter": result.drafter,
        "drafted_tokens": a.drafted_tokens if a else 0,
        "accepted_tokens": a.accepted_tokens if a else 0,
        "acceptance_rate": a.alpha if a else 0.0,
        "tau": a.tau if a else 1.0,
        "per_position_acceptance": a.per_position_acceptance if a else [],
        "ttft_s": result.ttft_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "cached_prompt_tokens": result.num_cached_prompt_tokens,
    }


class _Response:
    """What one request's sequences have produced so far: text, finish reasons, token counts, figures."""

    def __init__(self, parsed: ParsedRequest, accepted: Accepted, model_name: str) -> None:
        self.parsed = parsed
        self.model_name = model_name
        self.index = {request_id: i for i, request_id in enumerate(accepted.request_ids)}
        self.num_prompt_tokens = accepted.num_prompt_tokens
        n = len(accepted.request_ids)
        self.text = [""] * n
        self.finish = [None] * n
        self.completion_tokens = [0] * n
        self.finals: list[RequestOutput | None] = [None] * n
        self.id = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    @property
    def unfinished(self) -> list[str]:
        return [rid for rid, i in self.index.items() if self.finish[i] is None]

    def add(self, out: RequestOutput) -> int:
        i = self.index[out.request_id]
        self.text[i] += out.text
        self.completion_tokens[i] += len(out.token_ids)
        if out.finished:
            self.finish[i] = FINISH_REASONS.get(out.finish_reason, "stop")
            self.finals[i] = out
            if out.result is not None:
                self.text[i] = out.result.text
        return i

    def usage(self) -> dict:
        seen, prompt_tokens = set(), 0
        for i, p in enumerate(self.parsed.prompt_index):
            if p not in seen:
                seen.add(p)
                prompt_tokens += self.num_prompt_tokens[i]
        completion = sum(self.completion_tokens)
        cached = sum(f.result.num_cached_prompt_tokens for f in self.finals if f is not None and f.result is not None)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def figures(self) -> dict:
        """The request's speculation figures, summed over its sequences."""
        stats = [f.result.acceptance for f in self.finals if f is not None and f.result is not None]
        with_drafter = [a for a in stats if a is not None]
        drafted = sum(a.drafted_tokens for a in with_drafter)
        accepted = sum(a.accepted_tokens for a in with_drafter)
        steps = sum(a.steps for a in with_drafter)
        drafter = next((f.result.drafter for f in self.finals if f is not None and f.result is not None), "none")
        return {
            "drafter": drafter if with_drafter else "none",
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tau": sum(a.step_tokens for a in with_drafter) / steps if steps else 1.0,
        }

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def body(self) -> dict:
        choices = []
        for i in range(len(self.text)):
            choice = {"index": i, "finish_reason": self.finish[i], "logprobs": None}
            if self.parsed.chat:
                choice["message"] = {"role": "assistant", "content": self.text[i]}
            else:
                choice["text"] = self.text[i]
            choice["fastdecode"] = _choice_stats(self.finals[i]) if self.finals[i] is not None else None
            choices.append(choice)
        obj = "chat.completion" if self.parsed.chat else "text_completion"
        return {**self.head(obj), "choices": choices, "usage": self.usage(), "fastdecode": self.figures()}


def create_app(
    engine,
    *,
    model_name: str = "fastdecode",
    api_key: str | None = None,
    max_waiting: int = 128,
    default_max_tokens: int = 256,
    shutdown_timeout_s: float = 30.0,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` under the name ``model_name``.

    ``api_key``: required as ``Authorization: Bearer KEY`` on /v1/* (None: open).
    ``max_waiting``: the most sequences waiting for a running slot before new
    requests get 503 with Retry-After. ``default_max_tokens``: for requests
    that set neither max_tokens nor max_completion_tokens.
    """
    metrics = ServerMetrics(model_name)
    engine_loop = EngineLoop(engine, max_waiting=max_waiting, metrics=metrics)
    key = api_key.encode("utf-8") if api_key else None
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop, shutdown_timeout_s)

    app = FastAPI(title="fastdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = engine_loop
    app.state.metrics = metrics

    # -- errors: always OpenAI's schema, never a traceback --------------------------------
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        err = APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
        return await api_error(request, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return await api_error(request, APIError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error serving %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if key is None:
            return
        # Starlette decodes headers as latin-1: encoding back gives the bytes the client sent.
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), key):
            raise APIError(
                401,
                "missing or wrong API key (send Authorization: Bearer KEY)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    # -- generation ---------------------------------------------------------------------
    async def generate(request: Request, chat: bool):
        check_auth(request)
        parsed = parse(read_json(await request.body()), chat, default_max_tokens)
        check_model(parsed.model)
        try:  # errors in the options, at once (the engine thread checks the prompt)
            GenerationConfig.from_options(engine.config, **parsed.options[0])
        except FastDecodeError as exc:
            raise APIError(400, str(exc)) from None
        channel = Channel(asyncio.get_running_loop())
        request_ids = [f"{secrets.token_hex(8)}-{i}" for i in range(len(parsed.options))]
        engine_loop.submit(AddCommand(request_ids, _encoder(parsed), parsed.prompt_index, parsed.options, channel))
        try:
            first = await channel.get()
        except asyncio.CancelledError:
            engine_loop.abort(request_ids)
            raise
        if isinstance(first, Rejected):
            raise _rejection(first.error, parsed)
        response = _Response(parsed, first, model_name)
        if parsed.stream:
            return _EventStream(
                _stream(response, channel),
                on_close=lambda: engine_loop.abort(response.unfinished),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _collect(request, response, channel)

    def _rejection(error: Exception, parsed: ParsedRequest) -> APIError:
        if isinstance(error, ServerBusyError):
            return APIError(
                503,
                str(error),
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        param = "messages" if parsed.chat else "prompt"
        if isinstance(error, PromptTooLongError):
            return APIError(400, str(error), param=param, code="context_length_exceeded")
        if isinstance(error, FastDecodeError):
            return APIError(400, str(error))
        return APIError(500, "internal server error", type="server_error")

    async def _collect(request: Request, response: _Response, channel: Channel):
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
        return JSONResponse(response.body())

    async def _stream(response: _Response, channel: Channel):
        chat = response.parsed.chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = response.head(obj)
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
                    yield _sse({**head, "choices": [choice], **usage_field})
            failed = False
            while response.unfinished and not failed:
                item = await channel.get()
                if isinstance(item, Failed):
                    yield _sse(APIError(500, item.message, type="server_error").body())
                    failed = True
                    continue
                i = response.add(item)
                live = {
                    "index": i,
                    "tokens": len(item.token_ids),
                    "drafted": item.num_drafted,
                    "accepted": item.num_accepted,
                }
                finish = response.finish[i]
                if chat:
                    if item.text or item.token_ids:
                        choice = {"index": i, "delta": {"content": item.text}, "finish_reason": None, "logprobs": None}
                        yield _sse({**head, "choices": [choice], **usage_field, "fastdecode": live})
                        live = {"index": i, "tokens": 0, "drafted": 0, "accepted": 0}  # counted once
                    if finish is not None:
                        live["result"] = _choice_stats(item)
                        choice = {"index": i, "delta": {}, "finish_reason": finish, "logprobs": None}
                        yield _sse({**head, "choices": [choice], **usage_field, "fastdecode": live})
                elif item.text or item.token_ids or finish is not None:
                    if finish is not None:
                        live["result"] = _choice_stats(item)
                    choice = {"index": i, "text": item.text, "finish_reason": finish, "logprobs": None}
                    yield _sse({**head, "choices": [choice], **usage_field, "fastdecode": live})
            if response.parsed.include_usage and not failed:
                yield _sse({**head, "choices": [], "usage": response.usage(), "fastdecode": response.figures()})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the server is cancelling): free the sequences' KV blocks
            engine_loop.abort(response.unfinished)  # (_EventStream does it too, should this never have started)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    # -- the rest -------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        target = engine.target
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "fastdecode",
            "max_model_len": target.context_length,
            "fastdecode": {
                "backend": target.name,
                "weights": target.weights,
                "kv_cache_dtype": getattr(target, "kv_cache_dtype", None),
                "drafter": engine.drafter_name,
                "max_num_seqs": engine.max_num_seqs,
            },
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def index():
        return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html")

    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
    return app
