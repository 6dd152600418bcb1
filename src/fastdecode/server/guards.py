"""The checks every HTTP request passes before a route sees it, as one pure ASGI middleware
(pure ASGI, not Starlette's ``BaseHTTPMiddleware``, so streamed responses pass untouched):

* **Host allow-list** (against DNS rebinding: a web page whose name the attacker re-points
  at 127.0.0.1 reaches the server with its own name in ``Host``). By default only the
  loopback names (``localhost``, ``127.0.0.1``, ``[::1]``) and the address the server binds;
  ``--allowed-hosts`` adds names (``*.example.com`` patterns too), ``*`` allows any.
* **JSON bodies**: a POST must say ``Content-Type: application/json`` (or ``+json``), else
  415. A web page can send a ``text/plain`` POST to any address without a CORS preflight
  (a "simple request"); a JSON one needs a preflight this server never grants.
* **A body-size cap** (``--max-request-bytes``): a declared ``Content-Length`` over the cap
  is answered 413 before the body is read; an undeclared (chunked) body is counted as it
  arrives and refused once it passes the cap, so an oversized body is never held in memory.

Every refusal is in OpenAI's error schema. Starlette's ``TrustedHostMiddleware`` does the
host check but answers in plain text, hence this module.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.responses import JSONResponse

from fastdecode.server.protocol import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class RequestTooLargeError(APIError):
    """A request body over the cap (413). Raised by the counted ``receive`` wherever the body
    is read; an :class:`APIError`, so the app's error handler answers it in OpenAI's schema."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)",
            code="request_too_large",
        )


def normalize_host(host: str) -> str:
    """A host name or address as the allow-list compares it: lower case, no port, no trailing
    dot, IPv6 addresses in brackets ("::1" and "[::1]:8000" -> "[::1]")."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[: host.find("]") + 1] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    elif host.count(":") > 1:  # a bare IPv6 address (a --host value)
        host = f"[{host}]"
    return host.rstrip(".")


def normalize_pattern(pattern: str) -> str:
    pattern = pattern.strip()
    return pattern.lower() if pattern.startswith("*") else normalize_host(pattern)


def check_pattern(pattern: str) -> str:
    """An allow-list entry, or ValueError: a name, an address, "*.example.com" or "*"."""
    pattern = pattern.strip()
    if not pattern or ("*" in pattern[1:]) or (pattern.startswith("*") and pattern != "*" and pattern[1] != "."):
        raise ValueError(f"{pattern!r}: expected a host name, an address, '*.example.com' or '*'")
    return pattern


def allowed_hosts_for(bind_host: str | None, extra: Iterable[str] = ()) -> list[str]:
    """The default allow-list (loopback names and ``bind_host``) plus ``extra``."""
    hosts = [*LOOPBACK_HOSTS, *([bind_host] if bind_host else []), *extra]
    return list(dict.fromkeys(normalize_pattern(h) for h in hosts))


def host_matches(host: str, patterns: Iterable[str]) -> bool:
    """Whether ``host`` (normalized) is one of ``patterns``: a name, "*.example.com" (any
    subdomain, as Starlette's TrustedHostMiddleware reads it) or "*"."""
    return any(p == "*" or host == p or (p.startswith("*.") and host.endswith(p[1:])) for p in patterns)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class RequestGuard:
    """ASGI middleware: the host allow-list, JSON bodies and the body-size cap (see the module)."""

    def __init__(self, app, allowed_hosts: Iterable[str], max_request_bytes: int) -> None:
        self.app = app
        self.allowed_hosts = [normalize_pattern(check_pattern(h)) for h in allowed_hosts]
        self.allow_any = "*" in self.allowed_hosts
        self.max_request_bytes = max_request_bytes

    def refusal(self, scope) -> APIError | None:
        """Why this request is refused before it reaches the routes, or None."""
        host = _header(scope, b"host")
        if not self.allow_any and (host is None or not host_matches(normalize_host(host), self.allowed_hosts)):
            shown = "none" if host is None else repr(host[:100])
            return APIError(
                400,
                f"the Host header {shown} is not allowed; start the server with --allowed-hosts NAME "
                "to accept it (the default accepts only loopback names and the bound address)",
                code="host_not_allowed",
            )
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.strip().isdigit():
                return APIError(400, f"the Content-Length header {length[:40]!r} is not a number")
            if int(length) > self.max_request_bytes:
                return RequestTooLargeError(self.max_request_bytes)
        if scope["method"] in BODY_METHODS and not _is_json(_header(scope, b"content-type")):
            got = _header(scope, b"content-type")
            return APIError(
                415,
                f"the request body must be JSON sent with Content-Type: application/json (got {got or 'none'!r})",
                code="unsupported_media_type",
            )
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
            return
        limit, received = self.max_request_bytes, 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLargeError(limit)
            return message

        await self.app(scope, counted_receive, send)
