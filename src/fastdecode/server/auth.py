"""The API key: ``Authorization: Bearer KEY`` on /v1/*, compared in constant time."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from fastdecode.server.protocol import APIError
from fastdecode.server.state import ServerState, server_state


async def require_api_key(request: Request, state: Annotated[ServerState, Depends(server_state)]) -> None:
    """A router dependency: a 401 in OpenAI's schema unless the request carries the server's key."""
    key = state.api_key
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
