"""``fastdecode serve``: load a model, build the engine, serve it over HTTP with uvicorn.

Only argparse is imported here (``build_parser`` runs for every command);
FastAPI, uvicorn and the model load inside :func:`cmd_serve`.

SIGTERM (and Ctrl-C): uvicorn stops accepting connections and the engine thread
lets running requests finish for up to ``--shutdown-timeout`` seconds, then aborts
the rest (a stream ends with finish_reason "abort" and [DONE], a non-streamed request
gets a 503 in OpenAI's schema; :mod:`~fastdecode.server.shutdown`); the process then exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from fastdecode.args import EngineArgs, kernel_notes
from fastdecode.errors import ConfigError
from fastdecode.scaleout.options import add_replica_args, wants_replicas
from fastdecode.scaleout.ray_util import import_ray
from fastdecode.server.limits import DEFAULT_MAX_KV_SHARE, DEFAULT_MAX_N, RequestLimits
from fastdecode.util.commands import bounded, positive_int, print_notes

SERVE_LONG_PREFILL_TOKENS = 64
# A new request waits for a running slot at most this many tokens of a running request's turn
# (engine/scheduler.py: time slices): with the hog of issue 42 holding 3 of 8 slots, 8 clients' first
# tokens come within a few steps of what they take without it (tests/engine/test_fairness.py).
SERVE_TIME_SLICE_TOKENS = 32
_port = bounded(int, "a port number 0..65535", low=0, high=65535)
_seconds = bounded(float, "seconds >= 0", low=0)
WILDCARD_BINDS = {"0.0.0.0", "::", ""}


def _host_patterns(text: str) -> list[str]:
    """argparse type: a comma-separated list of allowed Host names."""
    from fastdecode.server.guards import check_pattern  # only when the flag is given: it imports FastAPI

    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise argparse.ArgumentTypeError("expected at least one host name")
    try:
        return [check_pattern(p) for p in patterns]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    s = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics, a web page)")
    # Streams are read by people: a prompt joining the batch advances 64 tokens a step, not 256.
    # Measured (bench-serve, gguf, 8 clients, 24 requests): inter-token latency p99 305 -> 138 ms,
    # TTFT p50 295 -> 312 ms, the same tokens/s (docs/benchmarks.md §8).
    EngineArgs.add_cli_args(
        s,
        defaults={
            "long_prefill_token_threshold": SERVE_LONG_PREFILL_TOKENS,
            "time_slice_tokens": SERVE_TIME_SLICE_TOKENS,
        },
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    s.add_argument("--port", type=_port, default=8000, help="port (default: %(default)s)")
    s.add_argument(
        "--api-key",
        default=os.environ.get("FASTDECODE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $FASTDECODE_API_KEY; unset: open)",
    )
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument(
        "--max-waiting",
        type=positive_int,
        default=128,
        help="sequences that may wait for a running slot; beyond it requests get 503 + Retry-After "
        "(default %(default)s)",
    )
    s.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=256,
        help="max tokens for requests that set neither max_tokens nor max_completion_tokens (default %(default)s)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="on SIGTERM, seconds running requests may take to finish before they are aborted (default %(default)s)",
    )
    s.add_argument(
        "--allowed-hosts",
        type=_host_patterns,
        action="extend",
        default=[],
        metavar="HOST[,HOST...]",
        help="Host header names served besides loopback (localhost, 127.0.0.1, [::1]) and --host: names, "
        "addresses, '*.example.com', or '*' for any (guards a server without --api-key against DNS rebinding)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=None,
        help="largest request body in bytes; a larger one gets 413 without being read (default: 4 MiB)",
    )
    _add_limit_args(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_replica_args(s)
    s.set_defaults(func=cmd_serve)
    return s


def _add_limit_args(s: argparse.ArgumentParser) -> None:
    """What one request may ask for (fastdecode.server.limits; its module docstring says how each applies)."""
    s.add_argument(
        "--max-n",
        type=positive_int,
        default=DEFAULT_MAX_N,
        metavar="N",
        help="most sequences one request may ask for: n, best_of, and its prompts x best_of; more is a 400 "
        "(default %(default)s)",
    )
    s.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="most new tokens one request may ask for: max_tokens x its sequences; more is clamped to an equal "
        "share each, and the response says so (default: the model's context length)",
    )
    s.add_argument(
        "--max-kv-share",
        type=bounded(float, "a number in (0, 1]", low=0, high=1, low_open=True),
        default=DEFAULT_MAX_KV_SHARE,
        metavar="F",
        help="fraction of the KV cache one request's sequences may hold at their longest (prompt + max_tokens "
        "each): the others always keep the rest; max_tokens is clamped to fit, and the response says so "
        "(default %(default)s)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from fastdecode.server.app import create_app
        from fastdecode.server.guards import DEFAULT_MAX_REQUEST_BYTES, allowed_hosts_for
        from fastdecode.server.shutdown import make_server
    except ImportError as exc:
        raise ConfigError(
            f"the server needs fastapi, uvicorn and prometheus-client ({exc}): "
            "pip install fastapi uvicorn prometheus-client"
        ) from None
    from fastdecode.server.engine_loop import build_off_main_thread

    engine_args, notes = EngineArgs.from_cli_args(args).clamped()
    print_notes(notes)
    if args.max_request_bytes is not None:  # a body is held whole while it is read
        from fastdecode.util.memory import check_fits

        check_fits(args.max_request_bytes, f"--max-request-bytes {args.max_request_bytes}", "lower it")
    app_options = dict(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or None,
        max_waiting=args.max_waiting,
        default_max_tokens=args.default_max_tokens,
        shutdown_timeout_s=args.shutdown_timeout,
        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        limits=RequestLimits(args.max_n, args.max_request_tokens, args.max_kv_share),
    )
    if args.host in WILDCARD_BINDS and not args.allowed_hosts:
        print(
            f"fastdecode: note: listening on {args.host or 'every address'}, but only Host headers naming "
            "loopback are served; add the names clients use with --allowed-hosts (or '*')",
            file=sys.stderr,
        )
    if wants_replicas(args):
        import_ray("fastdecode serve --replicas")
        from fastdecode.scaleout.serve import run_replicas

        return run_replicas(args, engine_args, app_options)
    config = engine_args.generation_config()

    def build():
        engine = engine_args.create_engine(config)
        print_notes(kernel_notes(engine))
        return engine

    engine = build_off_main_thread(build)
    app = create_app(engine, **app_options)
    server = make_server(app, host=args.host, port=args.port, log_level=args.log_level)
    # uvicorn re-raises the signal that stopped it once it has shut down; with a no-op handler
    # in place by then, a SIGTERM shutdown ends in exit status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    server.run()
    if not server.started:
        print(f"fastdecode: error: could not start the server on {args.host}:{args.port}", file=sys.stderr)
        return 1
    return 0
