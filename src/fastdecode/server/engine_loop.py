"""The thread that owns the engine.

The engine is not thread-safe, so one thread owns it: it takes commands (add a
group of sequences, abort sequences, drain and stop) from a thread-safe queue,
runs ``engine.step()`` while any request is unfinished, and hands each
:class:`RequestOutput` to the :class:`Channel` of the HTTP request it belongs
to. A channel carries items from this thread to one asyncio task through
``loop.call_soon_threadsafe``; the task reads, in order:

* :class:`Accepted` (the sequences were queued) or :class:`Rejected` (nothing
  was queued: bad input, the waiting queue full, shutting down), then
* the sequences' ``RequestOutput`` objects, each sequence ending with one whose
  ``finished`` is true (``finish_reason`` "abort" when the server aborted it), or
* :class:`Failed` if the engine raised: the server logs the traceback, aborts
  the channel's sequences and keeps serving.

Tokenization runs on this thread too (``AddCommand.encode``): a Hugging Face
fast tokenizer must not be used from two threads at once, and the engine's
detokenizers use it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastdecode.engine import RequestOutput
from fastdecode.errors import FastDecodeError
from fastdecode.server.limits import Grant, RequestLimits, grant_max_tokens

logger = logging.getLogger("fastdecode.server")
T = TypeVar("T")


class ServerBusyError(Exception):
    """The waiting queue is full, or the server is shutting down (HTTP 503 with Retry-After)."""


@dataclass
class Accepted:
    request_ids: list[str]
    num_prompt_tokens: list[int]  # per request
    grant: Grant | None = None  # the max_tokens each sequence got, if the limits clamped it


@dataclass
class Rejected:
    error: Exception  # a FastDecodeError (the client's fault) or ServerBusyError


@dataclass
class Failed:
    message: str


class Channel:
    """Items from the engine thread to one asyncio task, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:  # from any thread
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self):
        return await self._queue.get()


@dataclass
class AddCommand:
    """Queue ``len(options)`` sequences: sequence i gets prompt ``encode(engine)[prompt_index[i]]``
    and ``options[i]`` (``Engine.add_request`` keywords). All or none are queued."""

    request_ids: list[str]
    encode: Callable[[object], list[list[int]]]  # engine -> one list of token ids per distinct prompt
    prompt_index: list[int]
    options: list[dict]
    channel: Channel


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class StopCommand:
    deadline: float  # time.monotonic() by which running requests are aborted
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Tracked:
    channel: Channel
    num_prompt_tokens: int
    t_arrival: float
    t_last: float | None = None  # time of the last output with tokens


def build_off_main_thread(build: Callable[[], T]) -> T:
    """``build()`` (load the model, build the engine) on a short-lived thread; its result.

    Why: fastdecode's kernels and torch share one OpenMP runtime (libgomp), which
    keeps a pool of worker threads per thread that ever ran a parallel region.
    Loaded on the main thread, the model leaves the main thread's pool alive
    while the engine thread runs every pass with a pool of its own; with more
    pool threads than cores libgomp stops spinning at its barriers and sleeps
    on a futex instead. Measured on the 2-core Zen 3 (gguf weights, one
    request): a 1-row forward took 7.3 ms on the engine thread against 5.9 ms on
    the main thread. A pool dies with its thread, so building on a thread that
    then exits leaves the engine thread the only one: 6.1 ms."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="fastdecode-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class EngineLoop:
    """Owns ``engine`` on one thread; see the module docstring.

    ``max_waiting``: the most sequences that may wait for a running slot; an
    add that would exceed it (after filling free slots) is rejected with
    :class:`ServerBusyError`. ``metrics``: a ``ServerMetrics`` or None. ``limits``: what one
    request may ask for (:mod:`~fastdecode.server.limits`; its max_tokens is granted here,
    where its prompts' lengths are known).
    """

    def __init__(self, engine, max_waiting: int = 128, metrics=None, limits: RequestLimits | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._stopping: StopCommand | None = None  # the engine thread's view of _drain
        self._drain: StopCommand | None = None
        self._drain_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fastdecode-engine", daemon=True)
        self.alive = False

    # -- called from other threads ------------------------------------------------
    def start(self) -> None:
        self.alive = True
        self._thread.start()

    def submit(self, command: AddCommand) -> None:
        if not self.alive:
            command.channel.put(Rejected(ServerBusyError("the engine is not running")))
            return
        self._commands.put(command)

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(AbortCommand(list(request_ids)))

    def drain(self, timeout_s: float) -> StopCommand:
        """Begin to stop, returning at once: take no new requests, let running ones finish for up
        to ``timeout_s``, then finish the rest with ``finish_reason`` "abort", and end the thread.
        The server calls it as its shutdown begins (:mod:`~fastdecode.server.shutdown`), so the
        aborts reach the clients while their connections are still open. A second call keeps
        the first deadline."""
        with self._drain_lock:
            if self._drain is None:
                self._drain = StopCommand(time.monotonic() + timeout_s)
                self._commands.put(self._drain)
            return self._drain

    def stop(self, timeout_s: float) -> None:
        """:meth:`drain`, then wait for the thread to end."""
        if not self._thread.is_alive():
            return
        command = self.drain(timeout_s)
        command.done.wait(max(0.0, command.deadline - time.monotonic()) + 30.0)
        self._thread.join(5.0)

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                try:
                    # Idle: block for the next command (with a timeout, to notice a stop deadline).
                    command = self._commands.get(block=not busy, timeout=None if busy else 0.5)
                except queue.Empty:
                    command = None
                self._handle_all(command)
                if self._stopping is not None:
                    if time.monotonic() >= self._stopping.deadline:
                        self._abort_all("abort")
                    if not self.engine.has_unfinished():
                        break
                if self.engine.has_unfinished():
                    self._step()
                elif self.metrics is not None:
                    self.metrics.observe_engine(self.engine)
        finally:
            self.alive = False
            self._abort_all("abort")
            if self._stopping is not None:
                self._stopping.done.set()
            self._refuse_queued()

    def _handle_all(self, command) -> None:
        """Handle ``command`` (if any) and every command queued behind it."""
        while command is not None:
            try:
                self._handle(command)
            except Exception:  # a bug; the thread must live on
                logger.exception("handling %s failed", type(command).__name__)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None

    def _refuse_queued(self) -> None:
        """After the end: refuse what is still queued (``submit`` refuses what comes later)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddCommand):
                command.channel.put(Rejected(ServerBusyError("the server is shutting down")))
            elif isinstance(command, StopCommand):
                command.done.set()

    def _handle(self, command) -> None:
        if isinstance(command, AddCommand):
            self._add(command)
        elif isinstance(command, AbortCommand):
            for request_id in command.request_ids:
                tracked = self._tracked.pop(request_id, None)
                if tracked is not None:
                    self.engine.abort(request_id)
                    if self.metrics is not None:
                        self.metrics.observe_finished("abort")
        elif isinstance(command, StopCommand):
            if self._stopping is None:
                self._stopping = command
            else:
                command.done.set()

    def _add(self, command: AddCommand) -> None:
        engine = self.engine
        if self._stopping is not None:
            command.channel.put(Rejected(ServerBusyError("the server is shutting down")))
            return
        free_slots = max(0, engine.max_num_seqs - engine.num_running)
        if engine.num_waiting + len(command.options) > self.max_waiting + free_slots:
            full = f"the waiting queue is full ({engine.num_waiting} waiting, at most {self.max_waiting}); retry later"
            command.channel.put(Rejected(ServerBusyError(full)))
            return
        try:
            prompts = command.encode(engine)
            now = time.perf_counter()
            lengths = [len(prompts[i]) for i in command.prompt_index]
            grant = self._grant(lengths, command.options[0]["max_new_tokens"])
            specs = [
                dict(prompt=prompts[index], request_id=request_id, **{**options, "max_new_tokens": grant.max_tokens})
                for request_id, index, options in zip(command.request_ids, command.prompt_index, command.options)
            ]
            added = engine.add_requests(specs)  # all or none
        except Exception as exc:
            if not isinstance(exc, FastDecodeError):
                logger.exception("adding a request failed")
                exc = RuntimeError("internal error while adding the request")
            command.channel.put(Rejected(exc))
            return
        for request_id, length in zip(added, lengths):
            self._tracked[request_id] = _Tracked(command.channel, length, now)
        command.channel.put(Accepted(added, lengths, grant))

    def _grant(self, lengths: list[int], max_tokens: int) -> Grant:
        """The max_tokens each sequence gets; the KV share counts only where requests run side by side."""
        engine = self.engine
        pool = engine.block_pool
        num_blocks = pool.num_blocks if engine.batched and engine.max_num_seqs > 1 else None
        return grant_max_tokens(
            self.limits, lengths, max_tokens, engine.target.context_length, num_blocks, pool.block_size
        )

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; aborting the requests in flight")
            self._abort_all(None)
            return
        now = time.perf_counter()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted by its client after this step began
                continue
            if self.metrics is not None:
                self.metrics.observe_output(out, tracked, now)
            if out.token_ids:
                tracked.t_last = now
            if out.finished:
                del self._tracked[out.request_id]
                if self.metrics is not None:
                    self.metrics.observe_finished(out.finish_reason)
            tracked.channel.put(out)
        if self.metrics is not None:
            self.metrics.observe_engine(self.engine)

    def _abort_all(self, reason: str | None) -> None:
        """Abort every tracked sequence: tell its channel it finished with ``reason``, or failed (None)."""
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting %s failed", request_id)
            if reason is None:
                tracked.channel.put(Failed("internal error in the engine; the request was aborted"))
            else:
                tracked.channel.put(RequestOutput(request_id, [], "", True, reason))
            if self.metrics is not None:
                self.metrics.observe_finished("abort")
        self._tracked.clear()
        if self.metrics is not None:
            self.metrics.observe_engine(self.engine)
