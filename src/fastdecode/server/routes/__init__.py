"""The endpoints, one router per family. A new endpoint goes in the router of its family;
a new family is one new module here, added to ``ROUTERS``.

* ``completions`` - ``POST /v1/completions``;
* ``chat`` - ``POST /v1/chat/completions``;
* ``models`` - ``GET /v1/models``;
* ``ops`` - ``GET /health``, ``GET /metrics``, the chat page (``GET /``, ``/static``).

The /v1 routers require the API key (``fastdecode.server.auth``); ops is open.
"""

from __future__ import annotations

from fastdecode.server.routes.chat import router as chat_router
from fastdecode.server.routes.completions import router as completions_router
from fastdecode.server.routes.models import router as models_router
from fastdecode.server.routes.ops import router as ops_router

ROUTERS = (completions_router, chat_router, models_router, ops_router)
