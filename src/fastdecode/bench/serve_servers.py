"""The servers ``fastdecode bench-serve`` starts: how each is launched and found ready (``SERVERS``,
one entry each), and the subprocess that runs one."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdecode.bench.serve_results import FASTDECODE, LLAMA_CPP
from fastdecode.errors import ConfigError
from fastdecode.registry import Registry

STOP_TIMEOUT_S = 20.0  # after SIGTERM, before SIGKILL
LOG_TAIL_LINES = 12


class TimeLimitReached(Exception):
    """``--time-limit-s`` ran out: stop, and report what was measured."""


@dataclass(frozen=True)
class ServerKind:
    """A server this command can start: how, how to tell it is ready, what to add to every request."""

    name: str
    ready_path: str  # GET it until 200
    unavailable: Callable[[argparse.Namespace], str | None]  # why it cannot run here, or None
    command: Callable[[argparse.Namespace, int], list[str]]  # (args, port) -> argv
    extra_body: dict[str, Any] = field(default_factory=dict)


SERVERS: Registry[str, ServerKind] = Registry("server")


def _fastdecode_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fastdecode.cli",
        "serve",
        "--model",
        args.model,
        "--weights",
        args.weights,
        "--drafter",
        args.drafter,
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--shutdown-timeout",
        "5",
        *shlex.split(args.serve_args),
    ]


def _gguf_path(spec: str) -> str | None:
    from fastdecode.errors import FastDecodeError
    from fastdecode.loading import resolve_spec

    with contextlib.suppress(FastDecodeError):
        source = resolve_spec(spec)
        if source.kind == "gguf":
            return source.location
    return None


def _llama_cpp_unavailable(args: argparse.Namespace) -> str | None:
    # The server's extras, looked up without importing llama_cpp (that loads its shared library).
    missing = [
        m
        for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn", "fastapi")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        return f"llama-cpp-python[server] is not installed (missing {', '.join(missing)}; see scripts/setup_peer.sh)"
    if _gguf_path(args.model) is None:
        return f"{args.model} is not a GGUF model"
    return None


def _llama_cpp_command(args: argparse.Namespace, port: int) -> list[str]:
    # interrupt_requests defaults to True: a request arriving while another streams would end that
    # stream early ([DONE] mid-answer), which under concurrent load truncates nearly every response.
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        _gguf_path(args.model),
        "--n_threads",
        str(os.cpu_count() or 1),
        "--n_ctx",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--interrupt_requests",
        "false",
    ]


SERVERS.register(FASTDECODE)(ServerKind(FASTDECODE, "/health", lambda args: None, _fastdecode_command))
# The server's repeat_penalty defaults to 1.1, which changes even greedy output; 1.0 is plain greedy.
SERVERS.register(LLAMA_CPP)(
    ServerKind(LLAMA_CPP, "/v1/models", _llama_cpp_unavailable, _llama_cpp_command, extra_body={"repeat_penalty": 1.0})
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    last = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n  | ".join(["", *last]) if last else " (it printed nothing)"


class ServerProcess:
    """A server subprocess; its stdout and stderr go to ``log_path`` (a pipe could fill and stall it)."""

    def __init__(self, kind: ServerKind, argv: list[str], port: int, log_path: Path) -> None:
        self.kind, self.argv, self.log_path = kind, argv, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 (open while the server runs; stop() closes it)
        # Its own session: Ctrl-C reaches only this command, which then stops the server itself.
        # Without FASTDECODE_API_KEY: `fastdecode serve` would take it as its key and refuse our requests.
        env = {k: v for k, v in os.environ.items() if k != "FASTDECODE_API_KEY"}
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float, deadline: float) -> None:
        """Poll ``kind.ready_path`` until 200. ConfigError (with its log's last lines) if the process
        exits or ``timeout_s`` passes; TimeLimitReached at ``deadline`` (monotonic)."""
        import httpx

        give_up = min(time.monotonic() + timeout_s, deadline)
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ConfigError(
                    f"the {self.kind.name} server exited (status {code}) before it was ready; "
                    f"its last lines:{_tail(self.log_path)}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + self.kind.ready_path, timeout=2).status_code == 200:
                    return
            if time.monotonic() >= give_up:
                if give_up >= deadline:
                    raise TimeLimitReached(f"while the {self.kind.name} server was starting")
                raise ConfigError(
                    f"the {self.kind.name} server was not ready within {timeout_s:.0f} s "
                    f"(--start-timeout-s); its last lines:{_tail(self.log_path)}"
                )
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
