"""What the routes share: one :class:`ServerState` per app, kept at ``app.state.server``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from fastdecode.server.engine_loop import EngineLoop
from fastdecode.server.limits import RequestLimits
from fastdecode.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from fastdecode.engine import Engine


@dataclass
class ServerState:
    """One app's engine and settings (``create_app``'s arguments, see there)."""

    engine: Engine  # the routes read its settings; only the engine thread calls it
    engine_loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    api_key: bytes | None  # UTF-8; None: the API is open
    default_max_tokens: int
    shutdown_timeout_s: float
    started: int  # Unix time the app was built: the model card's "created"
    replica: str | None = None  # this server's name among replicas (fastdecode.scaleout); None: alone
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask for


async def server_state(request: Request) -> ServerState:
    """The app's :class:`ServerState` (a FastAPI dependency)."""
    return request.app.state.server
