"""``fastdecode serve``: an OpenAI-compatible HTTP server over the batched engine.

* ``app`` - the FastAPI app factory (``create_app(engine, ...)``): state, error handlers, routers;
* ``routes/`` - the endpoints, one router per family (completions, chat, models, ops);
* ``generation`` - a completion from request to response (submit to the engine thread, collect);
* ``sse`` - streamed responses (server-sent events) and ``response`` - the response body;
* ``auth`` - the API key dependency; ``errors`` - OpenAI's error schema for every error;
* ``state`` - what the routes share (``ServerState``);
* ``engine_loop`` - the one thread that owns the engine and loops ``step()``;
* ``protocol`` - request bodies checked into typed requests, and OpenAI's error schema;
* ``limits`` - what one request may ask for (``--max-n``, ``--max-request-tokens``, ``--max-kv-share``);
* ``access_log`` - uvicorn's access log, without query strings;
* ``metrics`` - Prometheus metrics named after vLLM's;
* ``cli`` - the ``serve`` command;
* ``static/`` - the chat page served at ``GET /``.

Nothing here is imported by the rest of the package but the front ends beside and above it:
``fastdecode.cli`` (which imports only ``cli``, so other commands do not load FastAPI) and
``fastdecode.scaleout``, which runs this app on Ray replicas.
"""
