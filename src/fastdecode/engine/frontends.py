"""The front ends: ``generate`` and ``stream``, loops over ``add_request`` / ``step``.

Each follows its requests through their outboxes (``OutputProcessor.outbox``); a consumer
that stops early aborts its request, freeing its KV blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from fastdecode.decoding.metrics import GenerationResult
from fastdecode.engine.config import GenerationConfig
from fastdecode.engine.output import OutputProcessor
from fastdecode.engine.request import RequestOutput


@dataclass
class Step:
    """What one step of the loop appended for a request (its prefill's first token is a step with no draft)."""

    token_ids: list[int]
    text: str  # newly decodable text (held back while it could be a partial stop string)
    num_drafted: int
    num_accepted: int


class GenerationStream:
    """Iterate for :class:`Step` objects; ``result`` is set once iteration ends."""

    def __init__(self, steps: Iterator[Step]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Step]:
        return self._steps


class EngineLoop(Protocol):
    """What a front end needs of the engine."""

    output_processor: OutputProcessor

    def add_request(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, chat: bool | None = None, **options
    ) -> str: ...

    def add_requests(self, requests: Sequence[dict], names: Sequence[str] | None = None) -> list[str]: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


def stream(
    engine: EngineLoop,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    chat: bool | None = None,
    **options,
) -> GenerationStream:
    request_id = engine.add_request(prompt, config, chat, **options)
    engine.output_processor.outbox[request_id] = deque()
    steps = GenerationStream(iter(()))
    steps._steps = _follow(engine, request_id, steps)
    return steps


def _follow(engine: EngineLoop, request_id: str, steps: GenerationStream) -> Iterator[Step]:
    outbox = engine.output_processor.outbox
    box = outbox[request_id]
    try:
        while True:
            while not box:
                engine.step()
            out = box.popleft()
            if out.token_ids or out.text or out.finished:
                yield Step(out.token_ids, out.text, out.num_drafted, out.num_accepted)
            if out.finished:
                steps.result = out.result
                return
    finally:
        outbox.pop(request_id, None)
        if steps.result is None:  # the consumer stopped early: free the request
            engine.abort(request_id)


def generate(
    engine: EngineLoop,
    prompt: str | Sequence[int] | list,
    config: GenerationConfig | None = None,
    chat: bool | None = None,
    **options,
) -> GenerationResult | list[GenerationResult]:
    """One prompt -> its GenerationResult; a list of prompts -> their results in
    input order, decoded together by continuous batching."""
    if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
        # every prompt is checked before any is queued: a bad one leaves the engine as it was
        specs = [dict(prompt=p, config=config, chat=chat, **options) for p in prompt]
        return _generate_all(engine, engine.add_requests(specs, names=[f"prompt {i}" for i in range(len(prompt))]))
    steps = stream(engine, prompt, config, chat, **options)
    for _ in steps:
        pass
    assert steps.result is not None
    return steps.result


def _generate_all(engine: EngineLoop, ids: list[str]) -> list[GenerationResult]:
    outbox = engine.output_processor.outbox
    for request_id in ids:
        outbox[request_id] = deque()
    results: dict[str, GenerationResult] = {}
    try:
        while len(results) < len(ids):
            engine.step()
            for request_id in ids:
                box = outbox.get(request_id)
                while box:
                    out = box.popleft()
                    if out.finished:
                        results[request_id] = out.result
    finally:
        for request_id in ids:
            outbox.pop(request_id, None)
            if request_id not in results:
                engine.abort(request_id)
    return [results[i] for i in ids]
