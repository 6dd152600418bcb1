"""Requests still running when ``--shutdown-timeout`` expires end with the documented abort
in OpenAI's schema (a stream: a final chunk with finish_reason "abort", then [DONE]; a
non-streamed request: a 503 error), not uvicorn's cancellation (a plain-text 500, a cut
stream). The server here is the one ``fastdecode serve`` runs (DrainingServer), on the tiny
model with slowed steps so that the requests outlive the timeout."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from fastdecode.engine import Engine
from fastdecode.server.app import create_app
from fastdecode.server.shutdown import ABORT_GRACE_S, make_server


class SlowEngine(Engine):
    def step(self):
        time.sleep(0.02)
        return super().step()


def test_requests_running_past_the_shutdown_timeout_end_with_abort(tiny_model, chat_tokenizer):
    engine = SlowEngine(tiny_model, chat_tokenizer, max_num_seqs=4)
    app = create_app(engine, model_name="tiny", shutdown_timeout_s=0.3)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = make_server(app, log_level="warning")
    assert server.config.timeout_graceful_shutdown == 0.3 + ABORT_GRACE_S
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 120, "temperature": 0}  # >= 2.4 s
    events: list[str] = []
    plain: list[httpx.Response] = []
    streaming = threading.Event()

    def read_stream():
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    streaming.set()

    def read_plain():
        plain.append(
            httpx.post(
                url + "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}, timeout=60
            )
        )

    readers = [threading.Thread(target=read_stream), threading.Thread(target=read_plain)]
    for reader in readers:
        reader.start()
    try:
        assert streaming.wait(30)
        time.sleep(0.1)
        server.should_exit = True  # what SIGTERM does
        for reader in readers:
            reader.join(30)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        server.should_exit = True
        sock.close()

    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    [r] = plain
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert r.json()["error"]["type"] == "server_error"
