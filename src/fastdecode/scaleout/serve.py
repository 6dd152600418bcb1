"""``fastdecode serve --replicas N``: the OpenAI server as a Ray Serve application.

Two deployments (Ray Serve's own: its proxy, its request router, its autoscaler, its health
checks and replacement of dead replicas):

* ``FastdecodeIngress`` (one replica, no CPU reserved) serves HTTP. It reads each request's
  body and sends it, as a :class:`~fastdecode.scaleout.forward.ForwardedRequest` carrying the
  prompt, to the engine deployment through a deployment handle, whose request router picks
  the replica: power of two choices (Ray Serve's default) or, with ``--routing prefix``, Ray
  Serve LLM's PrefixCacheAffinityRouter, which sends a prompt to the replica that already saw
  its longest prefix (where its KV blocks are cached). ``/health`` and ``/metrics`` are
  broadcast to every replica; metrics come back labelled ``replica="..."``.
* ``FastdecodeEngine`` (``--replicas`` of them, or autoscaled): one engine each, built from
  the same :class:`~fastdecode.args.EngineArgs` as ``fastdecode serve``, behind the single
  server's own FastAPI app (``create_app``), so the API, its errors and its streams are the
  same; each response's ``fastdecode`` object (and its ``x-fastdecode-replica`` header) names
  the replica.

A replica that dies while a request is on it: the ingress sends the request again, to another
replica, while no byte of the response has gone out (a non-streamed response goes out whole,
so it is always re-sent), up to ``retries`` times; after that, or once a stream has started,
the client gets a 503 in OpenAI's error schema (a stream gets it as its last event). Ray Serve
starts a replacement replica.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from fastdecode.args import EngineArgs
from fastdecode.scaleout.forward import ForwardedRequest, merge_metrics, run_asgi
from fastdecode.scaleout.ray_util import prefix_router_class
from fastdecode.server.errors import RETRY_AFTER_S, install_error_handlers
from fastdecode.server.protocol import APIError

logger = logging.getLogger("fastdecode.scaleout")

ENGINE_DEPLOYMENT = "FastdecodeEngine"
INGRESS_DEPLOYMENT = "FastdecodeIngress"
REPLICA_HEADER = "x-fastdecode-replica"
ROUTINGS = ("pow2", "prefix")
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
        }
        if self.max_replicas is not None:
            options["autoscaling_config"] = AutoscalingConfig(
                min_replicas=self.min_replicas if self.min_replicas is not None else 1,
                max_replicas=self.max_replicas,
                target_ongoing_requests=self.target_ongoing_requests,
            )
        else:
            options["num_replicas"] = self.num_replicas
        if self.routing == "prefix":
            # imbalanced_threshold: past this gap in queue lengths the router balances load
            # (power of two) instead of following prefixes.
            options["request_router_config"] = RequestRouterConfig(
                request_router_class=prefix_router_class(),
                request_router_kwargs={"imbalanced_threshold": max(2, self.max_ongoing_requests // 2)},
            )
        return options


@serve.deployment
class EngineReplica:
    """One engine behind the single server's FastAPI app."""

    def __init__(self, engine_args: EngineArgs, app_options: dict[str, Any]) -> None:
        import ray

        from fastdecode.server.app import create_app

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        engine = engine_args.create_engine(engine_args.generation_config())
        self.app = create_app(engine, replica=self.replica, **app_options)
        self.state = self.app.state.server
        self.state.engine_loop.start()  # what the app's lifespan does under uvicorn

    async def forward(self, request: ForwardedRequest):
        """The app's ASGI messages answering ``request`` (a streaming handle call)."""
        async for message in run_asgi(self.app, request):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica.encode())]
                message = {**message, "headers": headers}
            yield message

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


async def open_response(engine, request: ForwardedRequest, retries: int):
    """``(start message, the rest)`` of a replica's answer; a request whose replica died before
    answering is sent again (the router picks another replica), at most ``retries`` times."""
    last = None
    for _ in range(retries + 1):
        stream = engine.options(stream=True).forward.remote(request)
        try:
            return await stream.__anext__(), stream
        except RayError as exc:
            last = exc
            logger.warning("a replica failed before answering %s: %s", request.path, exc)
    raise unavailable(f"no replica could serve the request ({type(last).__name__}); retry later")


async def relay_body(stream, is_sse: bool):
    """The response body's chunks; a replica lost mid-stream ends the stream with a 503 error event."""
    try:
        async for message in stream:
            if message["type"] == "http.response.body":
                yield message.get("body", b"")
    except RayError as exc:
        logger.warning("a replica failed mid-response: %s", exc)
        if is_sse:
            error = unavailable("the replica serving this stream failed; retry the request").body()
            yield f"data: {json.dumps(error)}\n\n".encode()


def build_ingress_app(engine, retries: int) -> FastAPI:
    """The HTTP front: every route is relayed to a replica, but /health and /metrics ask them all."""
    app = FastAPI(title="fastdecode (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)
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
        start, stream = await open_response(engine, forwarded, retries)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
        is_sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(relay_body(stream, is_sse), status_code=start["status"], headers=headers)

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
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()  # set from here on: a SIGTERM while replicas start shuts down cleanly too
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(engine_args, app_options, replicas), name="fastdecode", route_prefix="/")
        print(f"fastdecode: serving on http://{args.host}:{args.port} ({ENGINE_DEPLOYMENT} on Ray Serve)", flush=True)
        while not stop.wait(1.0):
            pass
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
