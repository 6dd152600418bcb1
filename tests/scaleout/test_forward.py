"""The replica side of a relayed request (``run_asgi``'s batches) and which handle-call errors
count as a lost replica; no Ray instance needed."""

from __future__ import annotations

import asyncio

import pytest

from fastdecode.scaleout.forward import ForwardedRequest, run_asgi

START = {"type": "http.response.start", "status": 200, "headers": []}


def batches(app) -> list[list[dict]]:
    async def collect():
        return [batch async for batch in run_asgi(app, ForwardedRequest("POST", "/x", body=b"{}"))]

    return asyncio.run(collect())


def test_the_first_batch_holds_the_start_and_the_first_bytes():
    async def streaming(scope, receive, send):
        assert (await receive())["body"] == b"{}"
        await send(START)
        await asyncio.sleep(0.01)  # the start alone is not sent on
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"b", "more_body": False})

    assert batches(streaming) == [
        [START, {"type": "http.response.body", "body": b"a", "more_body": True}],
        [{"type": "http.response.body", "body": b"b", "more_body": False}],
    ]


def test_messages_sent_together_cross_together():
    async def whole(scope, receive, send):
        await receive()
        await send(START)
        for part in (b"a", b"b"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    [batch] = batches(whole)
    assert batch[0] == START and b"".join(m["body"] for m in batch[1:]) == b"ab" and len(batch) == 4


def test_an_app_that_fails_raises_after_what_it_sent():
    async def broken(scope, receive, send):
        await send(START)
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        raise ValueError("boom")

    got = []

    async def collect():
        async for batch in run_asgi(broken, ForwardedRequest("GET", "/x")):
            got.append(batch)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect())
    assert got == [[START, {"type": "http.response.body", "body": b"a", "more_body": True}]]


def test_which_errors_mean_a_lost_replica():
    pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

    from fastdecode.scaleout.serve import replica_lost

    assert replica_lost(ActorDiedError())
    assert replica_lost(ActorUnavailableError("gone", None))
    assert not replica_lost(RayTaskError("forward", "traceback", ValueError("the app's own bug")))
    assert not replica_lost(ValueError("not from Ray"))

    async def cancelled_elsewhere() -> bool:  # the replica's task was cancelled; this one was not
        return replica_lost(asyncio.CancelledError())

    assert asyncio.run(cancelled_elsewhere())

    async def cancelled_here() -> bool:  # the client went away: this task is being cancelled
        task = asyncio.current_task()
        task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError as exc:
            return replica_lost(exc)
        return True

    assert not asyncio.run(cancelled_here())
