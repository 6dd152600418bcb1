"""Errors as responses in OpenAI's schema, never a traceback.

``install_error_handlers(app)`` turns an :class:`~fastdecode.server.protocol.APIError`,
Starlette's own HTTP errors (404, 405), a body FastAPI could not validate and any
other exception into ``{"error": {...}}``; ``rejection_error`` maps what the engine
thread refused (:class:`~fastdecode.server.engine_loop.Rejected`) to its status.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdecode.errors import FastDecodeError, PromptTooLongError
from fastdecode.server.engine_loop import ServerBusyError
from fastdecode.server.protocol import APIError

logger = logging.getLogger("fastdecode.server")

RETRY_AFTER_S = 1


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if exc.status_code == 404 else None
    err = APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
    return await api_error(request, err)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await api_error(request, APIError(400, "invalid request"))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error serving %s", request.url.path)
    return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


def shutdown_error() -> APIError:
    """The response to a non-streamed request the server aborted as it shut down (a stream
    ends instead with a chunk whose finish_reason is "abort")."""
    return APIError(
        503,
        "the server shut down before this request finished (--shutdown-timeout); send it again",
        type="server_error",
        code="server_shutting_down",
    )


def rejection_error(error: Exception, chat: bool) -> APIError:
    """The response to a request the engine thread did not queue (``error``: why)."""
    if isinstance(error, ServerBusyError):
        return APIError(
            503,
            str(error),
            type="server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    param = "messages" if chat else "prompt"
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), param=param, code="context_length_exceeded")
    if isinstance(error, FastDecodeError):
        return APIError(400, str(error))
    return APIError(500, "internal server error", type="server_error")
