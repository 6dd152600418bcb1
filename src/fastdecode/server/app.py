"""The HTTP layer: an OpenAI-compatible FastAPI app over an :class:`~fastdecode.engine.Engine`.

``create_app(engine, model_name=...)`` takes an engine that is already built
(the CLI loads a model; tests pass a tiny one) and assembles the app: a
:class:`~fastdecode.server.state.ServerState`, the error handlers
(:mod:`~fastdecode.server.errors`) and the routers (:mod:`~fastdecode.server.routes`).
Its lifespan starts the :class:`~fastdecode.server.engine_loop.EngineLoop` thread
and, at shutdown, lets running requests finish for up to ``shutdown_timeout_s``
before aborting the rest.

Engine finish reasons map to OpenAI's: eos and stop strings -> "stop", max tokens
and the context length -> "length"; "abort" appears only for requests the server
aborted while shutting down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from fastdecode.server.access_log import strip_queries_from_access_log
from fastdecode.server.engine_loop import EngineLoop
from fastdecode.server.errors import install_error_handlers
from fastdecode.server.guards import DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_HOSTS, RequestGuard
from fastdecode.server.limits import RequestLimits
from fastdecode.server.metrics import ServerMetrics
from fastdecode.server.routes import ROUTERS
from fastdecode.server.routes.ops import mount_static
from fastdecode.server.state import ServerState


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.server
    state.engine_loop.start()
    try:
        yield
    finally:
        await asyncio.to_thread(state.engine_loop.stop, state.shutdown_timeout_s)


def create_app(
    engine,
    *,
    model_name: str = "fastdecode",
    api_key: str | None = None,
    max_waiting: int = 128,
    default_max_tokens: int = 256,
    shutdown_timeout_s: float = 30.0,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    replica: str | None = None,
    limits: RequestLimits | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` under the name ``model_name``.

    ``api_key``: required as ``Authorization: Bearer KEY`` on /v1/* (None: open).
    ``max_waiting``: the most sequences waiting for a running slot before new
    requests get 503 with Retry-After. ``default_max_tokens``: for requests
    that set neither max_tokens nor max_completion_tokens. ``allowed_hosts``: the
    ``Host`` names served (``"*"``: any; see :mod:`~fastdecode.server.guards`);
    ``max_request_bytes``: the largest request body (413 beyond it). ``replica``: the
    name each response's ``fastdecode`` object gives as ``replica`` (one of several
    replicas behind a router; None: not named). ``limits``: what one request may ask for
    (:mod:`~fastdecode.server.limits`: ``n``, max_tokens x sequences, the KV share).
    """
    limits = limits or RequestLimits()
    strip_queries_from_access_log()  # (again in make_server, after uvicorn's logging is set up)
    metrics = ServerMetrics(model_name)
    state = ServerState(
        engine=engine,
        engine_loop=EngineLoop(engine, max_waiting=max_waiting, metrics=metrics, limits=limits),
        metrics=metrics,
        model_name=model_name,
        api_key=api_key.encode("utf-8") if api_key else None,
        default_max_tokens=default_max_tokens,
        shutdown_timeout_s=shutdown_timeout_s,
        started=int(time.time()),
        replica=replica,
        limits=limits,
    )
    app = FastAPI(title="fastdecode", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.engine_loop = state.engine_loop
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts, max_request_bytes=max_request_bytes)
    for router in ROUTERS:
        app.include_router(router)
    mount_static(app)
    return app
