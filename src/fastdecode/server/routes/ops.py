"""What operators and browsers use, open even with an API key: ``GET /health``,
``GET /metrics`` (Prometheus) and the chat page (``GET /`` and its ``/static`` files,
shipped in the package: nothing is fetched from the internet)."""

from __future__ import annotations

from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from fastdecode.server.state import ServerState, server_state

STATIC_DIR = resources.files("fastdecode.server") / "static"

router = APIRouter()


@router.get("/health")
async def health(state: Annotated[ServerState, Depends(server_state)]):
    if not state.engine_loop.alive:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus_metrics(state: Annotated[ServerState, Depends(server_state)]) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/")
async def index() -> FileResponse:
    return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html")


def mount_static(app: FastAPI) -> None:
    """Serve the chat page's files at /static (a router cannot carry a mount)."""
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
