"""``fastdecode serve --replicas N``: the OpenAI server as a Ray Serve application.

Two deployments (Ray Serve's own: its proxy, its request router, its autoscaler, its health
checks and replacement of dead replicas):

* ``FastdecodeIngress`` (one replica, no CPU reserved) serves HTTP. It reads each request's
  body and sends it, as a :class:`~fastdecode.scaleout.forward.ForwardedRequest` carrying the
  prompt, to the engine deployment through a deployment handle (over Ray Serve's gRPC
  transport), whose request router picks the replica (``routers.py``): power of two choices
  (Ray Serve's default), round robin, or Ray Serve LLM's PrefixCacheAffinityRouter, which sends
  a prompt to the replica that already saw its longest prefix (where its KV blocks are cached).
  ``/health`` and ``/metrics`` are broadcast to every replica; metrics come back labelled
  ``replica="..."``. It is a deployment of its own, rather than the engine replicas taking
  HTTP from Ray Serve's proxy directly, because the proxy's router never sees a request's body
  (no prefix routing), and a replica lost under the proxy is a bare 500, never retried.
* ``FastdecodeEngine`` (``--replicas`` of them, or autoscaled): one engine each, built from
  the same :class:`~fastdecode.args.EngineArgs` as ``fastdecode serve``, behind the single
  server's own FastAPI app (``create_app``), so the API, its errors and its streams are the
  same; each response's ``fastdecode`` object (and its ``x-fastdecode-replica`` header) names
  the replica.

A replica that dies while a request is on it: a replica sends its answer in batches of ASGI
messages, the first holding the status, the headers and the first body bytes together (a whole
answer, when it is not streamed), so the ingress commits to a response only once it holds that
batch. Lost before it (the actor died or became unavailable, its task was cancelled, Ray Serve
refused it), the request is sent again, to another replica, up to ``retries`` times; after that
the client gets a 503 in OpenAI's error schema. A stream lost after its first bytes ends with a
503 error event. Ray Serve starts a replacement replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.exceptions import RayServeException

from fastdecode.args import EngineArgs
from fastdecode.scaleout.forward import ForwardedRequest, merge_metrics, run_asgi
from fastdecode.scaleout.routers import ROUTERS
from fastdecode.server.errors import RETRY_AFTER_S, install_error_handlers
from fastdecode.server.protocol import APIError

logger = logging.getLogger("fastdecode.scaleout")

ENGINE_DEPLOYMENT = "FastdecodeEngine"
INGRESS_DEPLOYMENT = "FastdecodeIngress"
REPLICA_HEADER = "x-fastdecode-replica"
ROUTINGS = tuple(ROUTERS)
# Ray Serve writes an access log line per request in its proxy and in every replica it passes
# through, and INFO lines besides: on a busy server that is CPU the engine could use.
SERVE_LOGGING = {"log_level": "WARNING", "enable_access_log": False}
# The ingress calls the engine replicas over Ray Serve's gRPC transport (a gRPC stream per
# request, plain pickle) rather than as Ray actor tasks (an object per streamed item): measured,
# it halves the CPU the ingress and the proxy spend per generated token (docs/scale-out.md).
HANDLE_OPTIONS = {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}
# Ray Serve's proxy takes the same transport from this variable, read when its process starts.
SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass(frozen=True)
class ReplicaOptions:
    """How many engine replicas, what each holds, and how requests are routed among them.

    Autoscaling is on when ``max_replicas`` is set: Ray Serve keeps between ``min_replicas``
    and ``max_replicas``, aiming at ``target_ongoing_requests`` requests per replica."""

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    max_ongoing_requests: int = 16  # requests one replica holds at once (its engine batches them)
    num_cpus: float = 1.0  # per replica; Ray sets OMP_NUM_THREADS to it, so torch uses that many threads
    num_gpus: float = 0.0
    routing: str = "pow2"
    retries: int = 2

    def engine_deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "name": ENGINE_DEPLOYMENT,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "health_check_period_s": 2,
            "logging_config": SERVE_LOGGING,
        }
        if self.max_replicas is not None:
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=self.min_replicas if self.min_replicas is not None else 1,
                max_replicas=self.max_replicas,
                target_ongoing_requests=self.target_ongoing_requests,
            )
        else:
            options["num_replicas"] = self.num_replicas
        kwargs = {}
        if self.routing == "prefix":
            # imbalanced_threshold: past this gap in queue lengths the router balances load
            # (power of two) instead of following prefixes.
            kwargs = {"imbalanced_threshold": max(2, self.max_ongoing_requests // 2)}
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTERS[self.routing], request_router_kwargs=kwargs
        )
        return options


@serve.deployment
class EngineReplica:
    """One engine behind the single server's FastAPI app."""

    def __init__(self, engine_args: EngineArgs, app_options: dict[str, Any]) -> None:
        import ray

        from fastdecode.server.app import create_app
        from fastdecode.server.engine_loop import build_off_main_thread

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        # Built on a thread that then exits, as `fastdecode serve` builds it: the engine thread
        # is then the only one holding an OpenMP pool (see build_off_main_thread).
        engine = build_off_main_thread(lambda: engine_args.create_engine(engine_args.generation_config()))
        self.app = create_app(engine, replica=self.replica, **app_options)
        self.state = self.app.state.server
        self.state.engine_loop.start()  # what the app's lifespan does under uvicorn

    async def forward(self, request: ForwardedRequest):
        """Batches of the app's ASGI messages answering ``request`` (a streaming handle call);
        the first holds the response's start and its first body bytes (``run_asgi``)."""
        first = True
        async for batch in run_asgi(self.app, request):
            if first and batch[0]["type"] == "http.response.start":
                start = batch[0]
                headers = [*start.get("headers", []), (REPLICA_HEADER.encode(), self.replica.encode())]
                batch = [{**start, "headers": headers}, *batch[1:]]
            first = False
            yield batch

    def info(self) -> dict[str, Any]:
        return {"replica": self.replica, "actor_name": self.actor_name, "alive": self.state.engine_loop.alive}

    def metrics(self) -> tuple[str, str]:
        return self.replica, self.state.metrics.render().decode("utf-8")

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        if not self.state.engine_loop.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.engine_loop.stop(state.shutdown_timeout_s)


def unavailable(message: str) -> APIError:
    return APIError(
        503, message, type="server_overloaded", code="replica_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def replica_lost(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a handle call, means the replica failed rather than the request:
    a Ray error (the actor died or is unavailable), a gRPC transport error, Ray Serve refusing
    the request, or the replica's task cancelled, which Ray raises here as ``CancelledError``
    while this task is not being cancelled. Not lost: the app's own exception (a retry would
    only repeat it), and this task's cancellation (the client went away: it must propagate)."""
    if isinstance(exc, asyncio.CancelledError):
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
        return cancelling is not None and cancelling() == 0
    if isinstance(exc, RayTaskError):  # raised on the replica: lost only if an actor died under it
        return isinstance(exc.cause, RayActorError)
    # grpc.aio.AioRpcError: the call's transport failed (the app's own errors come back as values)
    return isinstance(exc, (RayError, RayServeException, grpc.aio.AioRpcError))


async def open_response(stream_handle, request: ForwardedRequest, retries: int) -> tuple[list[dict], Any]:
    """The first batch of a replica's answer (its start and first body bytes) and the stream of
    the rest; a request whose replica was lost before that batch is sent again (the router picks
    a live replica), at most ``retries`` times, then answered 503."""
    last: BaseException | None = None
    for _ in range(retries + 1):
        stream = stream_handle.forward.remote(request)
        try:
            return await stream.__anext__(), stream
        except StopAsyncIteration:
            last = RuntimeError("the replica's app sent no response")
        except BaseException as exc:
            if not replica_lost(exc):
                raise
            last = exc
        logger.warning("a replica failed before answering %s: %r", request.path, last)
    raise unavailable(f"no replica could serve the request ({type(last).__name__}); retry later")


def _bodies(batch: list[dict]) -> tuple[bytes, bool]:
    """The body bytes in ``batch``, and whether its last body message ends the response."""
    bodies = [m for m in batch if m["type"] == "http.response.body"]
    return b"".join(m.get("body", b"") for m in bodies), bool(bodies) and not bodies[-1].get("more_body", False)


async def relay_body(first: bytes, stream, is_sse: bool):
    """The response body's chunks, ``first`` first; a replica lost mid-stream ends an event
    stream with a 503 error event."""
    if first:
        yield first
    try:
        async for batch in stream:
            chunk, _ = _bodies(batch)
            if chunk:
                yield chunk
    except BaseException as exc:
        if not replica_lost(exc):
            raise
        logger.warning("a replica failed mid-response: %r", exc)
        if is_sse:
            error = unavailable("the replica serving this stream failed; retry the request").body()
            yield f"data: {json.dumps(error)}\n\n".encode()


async def _finish(stream) -> None:
    """Read a whole answer's stream to its end, so the replica's call completes cleanly (a
    replica lost now has already given the answer)."""
    try:
        async for _ in stream:
            pass
    except BaseException as exc:
        if not replica_lost(exc):
            raise


def build_ingress_app(engine, retries: int) -> FastAPI:
    """The HTTP front: every route is relayed to a replica, but /health and /metrics ask them all."""
    app = FastAPI(title="fastdecode (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)
    stream_handle = engine.options(stream=True, **HANDLE_OPTIONS)
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        infos = await engine.broadcast("info").results_async(return_exceptions=True)
        alive = sorted(i["replica"] for i in infos if isinstance(i, dict) and i["alive"])
        return JSONResponse(
            {"status": "ok" if alive else "unavailable", "replicas": alive}, status_code=200 if alive else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        results = await engine.broadcast("metrics").results_async(return_exceptions=True)
        text = merge_metrics([r for r in results if isinstance(r, tuple)])
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=_METHODS)
    async def relay(request: Request, path: str) -> Response:
        forwarded = ForwardedRequest.from_http(
            request.method, "/" + path, request.scope.get("query_string", b""), list(request.headers.raw),
            await request.body(),
        )  # fmt: skip
        batch, stream = await open_response(stream_handle, forwarded, retries)
        start = batch[0]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
        first, complete = _bodies(batch)
        if complete:  # an answer that was not streamed: the client gets it whole
            await _finish(stream)
            return Response(first, status_code=start["status"], headers=headers)
        is_sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(relay_body(first, stream, is_sse), status_code=start["status"], headers=headers)

    return app


# The ingress only parses bodies and relays bytes, asynchronously: it holds every client's
# request at once (Ray Serve's default, 5 per replica, would queue clients at the proxy and cap
# the service at 5 concurrent requests); the engine replicas' max_ongoing_requests bound the work.
INGRESS_MAX_ONGOING_REQUESTS = 4096


@serve.deployment(
    name=INGRESS_DEPLOYMENT,
    num_replicas=1,
    max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": 0},
    logging_config=SERVE_LOGGING,
)
@serve.ingress()
class Ingress:
    def __init__(self, engine, retries: int) -> None:
        self.engine = engine
        self.retries = retries

    def __serve_build_asgi_app__(self):
        return build_ingress_app(self.engine, self.retries)


def build_application(engine_args: EngineArgs, app_options: dict[str, Any], replicas: ReplicaOptions):
    """The Ray Serve application (``serve.run`` it): the ingress bound to the engine deployment."""
    engine = EngineReplica.options(**replicas.engine_deployment_options()).bind(engine_args, app_options)
    return Ingress.bind(engine, replicas.retries)


def replica_options(args) -> ReplicaOptions:
    """The replica options of a parsed ``serve`` command line (flags in ``scaleout.options``)."""
    return ReplicaOptions(
        num_replicas=args.replicas or 1,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        routing=args.routing,
    )


def run_replicas(args, engine_args: EngineArgs, app_options: dict[str, Any]) -> int:
    """Serve on Ray Serve until SIGTERM or Ctrl-C, then shut the application down."""
    import signal
    import threading

    import ray

    engine_args.validate()  # one ConfigError before Ray starts
    replicas = replica_options(args)
    if args.ray_address is None:  # Ray starts here: its processes inherit this environment
        for name, value in SERVE_ENV.items():
            os.environ.setdefault(name, value)
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()  # set from here on: a SIGTERM while replicas start shuts down cleanly too
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=SERVE_LOGGING)
        serve.run(build_application(engine_args, app_options, replicas), name="fastdecode", route_prefix="/")
        print(f"fastdecode: serving on http://{args.host}:{args.port} ({ENGINE_DEPLOYMENT} on Ray Serve)", flush=True)
        while not stop.wait(1.0):
            pass
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
