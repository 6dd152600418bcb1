"""uvicorn's server, with a shutdown that ends running requests the documented way.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, waits up to its graceful
timeout for running responses, then cancels them: a non-streamed request got a 500 with
a plain-text body and a stream was cut with no ``finish_reason`` and no ``[DONE]``. The
engine thread, told only at the lifespan's end (after that cancellation), could not
finish them itself.

:class:`DrainingServer` tells the engine thread as shutdown begins
(:meth:`~fastdecode.server.engine_loop.EngineLoop.drain`): running requests may finish
for ``shutdown_timeout_s``, then the engine thread aborts the rest, and each ends in
OpenAI's schema while its connection is still open: a stream with a final chunk whose
``finish_reason`` is "abort" and ``[DONE]``, a non-streamed request with a 503 error
(``code: server_shutting_down``). uvicorn's own timeout is set ``ABORT_GRACE_S`` later,
a backstop for a response that does not end even then.
"""

from __future__ import annotations

import uvicorn

from fastdecode.server.access_log import strip_queries_from_access_log

ABORT_GRACE_S = 10.0  # after the engine's deadline: time for the aborted responses to be sent


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` for an app from :func:`~fastdecode.server.app.create_app`."""

    def __init__(self, config: uvicorn.Config) -> None:
        state = config.app.state.server
        self.engine_loop = state.engine_loop
        self.shutdown_timeout_s = state.shutdown_timeout_s
        config.timeout_graceful_shutdown = self.shutdown_timeout_s + ABORT_GRACE_S
        super().__init__(config)

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.drain(self.shutdown_timeout_s)
        await super().shutdown(sockets=sockets)


def make_server(app, **config) -> DrainingServer:
    """A :class:`DrainingServer` for ``app``; ``config``: ``uvicorn.Config``'s keywords. Its access
    log keeps no query strings (:mod:`~fastdecode.server.access_log`)."""
    server = DrainingServer(uvicorn.Config(app, **config))  # (the Config sets up uvicorn's logging)
    strip_queries_from_access_log()
    return server
