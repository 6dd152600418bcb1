"""``GET /v1/models``: the one model served, with a ``fastdecode`` card."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from fastdecode.server.auth import require_api_key
from fastdecode.server.state import ServerState, server_state

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def models(state: Annotated[ServerState, Depends(server_state)]):
    engine = state.engine
    target = engine.target
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
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
