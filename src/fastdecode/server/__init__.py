"""``fastdecode serve``: an OpenAI-compatible HTTP server over the batched engine.

* ``app`` - the FastAPI app factory (``create_app(engine, ...)``) and the endpoints;
* ``engine_loop`` - the one thread that owns the engine and loops ``step()``;
* ``protocol`` - request bodies checked into typed requests, and OpenAI's error schema;
* ``metrics`` - Prometheus metrics named after vLLM's;
* ``cli`` - the ``serve`` command;
* ``static/`` - the chat page served at ``GET /``.

Nothing here is imported by the rest of the package but ``fastdecode.cli``
(which imports only ``cli``, so other commands do not load FastAPI).
"""
