"""``POST /v1/completions``: raw text or token ids, no chat template."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from fastdecode.server.auth import require_api_key
from fastdecode.server.generation import generate
from fastdecode.server.state import ServerState, server_state

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post("/v1/completions")
async def completions(request: Request, state: Annotated[ServerState, Depends(server_state)]) -> Response:
    return await generate(request, state, chat=False)
