"""uvicorn's access log without query strings.

A client may send its API key as ``?api_key=...``: the server refuses it (the key goes in the
``Authorization`` header), but uvicorn's access log wrote the request's path with its query,
so the key ended up in a log file. The log keeps the path, never the query (which no endpoint
of this server reads).
"""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"


class QueryFreeAccessLog(logging.Filter):
    """Drops the query from uvicorn's access-log records: ``'%s - "%s %s HTTP/%s" %d'`` with
    (client, method, path with query, HTTP version, status) as its arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def strip_queries_from_access_log() -> None:
    """Install the filter on uvicorn's access logger (once; after ``uvicorn.Config`` has set up logging)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QueryFreeAccessLog) for f in logger.filters):
        logger.addFilter(QueryFreeAccessLog())
