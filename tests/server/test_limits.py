"""No request can hold the server (issue 42): a hog request next to ordinary ones, the limits an
operator sets (``fastdecode.server.limits``), and the last bad inputs of the probe (a deeply nested
body, a lone surrogate in ``stop``, an API key in the query string)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from tiny_models import tiny_llama

from fastdecode import Engine
from fastdecode.errors import ConfigError
from fastdecode.server.app import create_app
from fastdecode.server.limits import RequestLimits, grant_max_tokens

CONTEXT = 1024
# issue 42, item 1: accepted (2 sequences running, 1 waiting), and a normal chat request then timed out
HOG = {"prompt": "Once upon a time", "max_tokens": 1_000_000_000, "min_tokens": 8000, "n": 3, "stream": True, "seed": 7}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def long_model():
    """The tiny Llama with a 1,024-token context: a hog runs long enough to be running while others come and go."""
    return tiny_llama(0, max_position_embeddings=CONTEXT)


def _engine(long_model, chat_tokenizer, **kwargs) -> Engine:
    # Before issue 42, each hog sequence reserved 64 blocks (its whole context) of these 100: two ran and the
    # third waited, every later request behind it.
    return Engine(long_model, chat_tokenizer, max_num_seqs=8, num_kv_blocks=100, **kwargs)


async def _hog_stream(client: httpx.AsyncClient, done: dict) -> tuple[list[str], dict]:
    texts, clamped = ["", "", ""], None
    async with client.stream("POST", "/v1/completions", json=HOG) as r:
        assert r.status_code == 200, await r.aread()
        clamped = r.headers.get("X-Fastdecode-Clamped")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    done["hog"] = time.monotonic()
    return texts, clamped


async def _chat(client: httpx.AsyncClient, body: dict, done: dict, name: str) -> str:
    await asyncio.sleep(0.2)  # after the hog is running
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    done[name] = time.monotonic()
    return r.json()["choices"][0]["message"]["content"]


def test_a_hog_request_holds_nobody_back(long_model, chat_tokenizer, serve_app):
    """The hog of item 1 runs (its max_tokens clamped to the context, and the response says so), a
    normal chat request finishes while it runs, 8 clients with ordinary requests (64 new tokens) all
    finish, and every one gets the tokens it gets alone; the pool is empty at the end."""
    clients = [
        {"messages": [{"role": "user", "content": f"tell me about {w}"}], "max_tokens": 64, "temperature": 0}
        for w in ("cats", "dogs", "the sea", "rain", "bread", "trains", "stars", "snow")
    ]
    engine = _engine(long_model, chat_tokenizer)

    async def together(url: str):
        done: dict = {}
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            return (
                await asyncio.gather(
                    _hog_stream(c, done),
                    _chat(c, CHAT, done, "chat"),
                    *(_chat(c, body, done, f"client{i}") for i, body in enumerate(clients)),
                ),
                done,
            )

    with serve_app(create_app(engine, model_name="tiny")) as server:
        ((hog, clamped), chat, *answers), done = asyncio.run(together(server.url))
        with httpx.Client(base_url=server.url, timeout=300) as c:  # each alone, one after another
            alone_chat = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
            alone = [c.post("/v1/chat/completions", json=b).json()["choices"][0]["message"]["content"] for b in clients]
            alone_hog = [
                ch["text"] for ch in c.post("/v1/completions", json={**HOG, "stream": False}).json()["choices"]
            ]
    assert done["chat"] < done["hog"]  # served while the hog ran (it was queued behind the hog's third sequence)
    assert clamped.startswith("max_tokens=") and "requested=1000000000" in clamped  # (within the KV share)
    assert chat == alone_chat and answers == alone
    assert hog == alone_hog and all(len(text) > 0 for text in hog)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks and not engine.has_unfinished()


def test_n_and_best_of_over_the_limit_are_400(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        for body, param in (({"prompt": "x", "n": 65}, "n"), ({"prompt": "x", "best_of": 100}, "best_of")):
            r = c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
            assert "--max-n" in r.json()["error"]["message"]


def test_limits_an_operator_sets(tiny_model, chat_tokenizer, serve_app):
    limits = RequestLimits(max_n=2, max_request_tokens=20, max_kv_share=0.25)
    engine = Engine(tiny_model, chat_tokenizer, max_num_seqs=4, num_kv_blocks=32)  # 8 blocks to a request
    app = create_app(engine, model_name="tiny", limits=limits)
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 2})
        assert r.status_code == 400 and "at most 2" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "xy", "n": 2, "max_tokens": 50, "temperature": 0})
        assert r.status_code == 200 and r.json()["fastdecode"]["clamped"]["max_tokens"]["granted"] == 10
        r = c.post("/v1/completions", json={"prompt": "x" * 120, "max_tokens": 2})  # 8 blocks: the whole share
        assert r.status_code == 200 and "clamped" not in r.json()["fastdecode"]
        r = c.post("/v1/completions", json={"prompt": ["x" * 120, "y" * 120], "max_tokens": 2})
        assert r.status_code == 400 and "--max-kv-share" in r.json()["error"]["message"]


def test_grant_max_tokens():
    limits = RequestLimits(max_request_tokens=None, max_kv_share=0.5)
    assert grant_max_tokens(limits, [10], 50, 128, 64, 16).clamped() is None
    grant = grant_max_tokens(limits, [10, 10, 10, 10], 100, 128, 64, 16)  # 4 x 100 > the context, 128
    assert grant.max_tokens == 32 and "--max-request-tokens 128" in grant.limit
    grant = grant_max_tokens(limits, [40, 40], 50, 128, 16, 16)  # 8 of 16 blocks: 2 x 64 positions, no more
    assert grant.max_tokens == 24 and "--max-kv-share 0.5" in grant.limit
    assert grant_max_tokens(limits, [10], 1000, 128, None, 16).max_tokens == 128  # no share where one runs at a time
    with pytest.raises(ConfigError, match="more than --max-kv-share"):
        grant_max_tokens(limits, [120, 120], 2, 128, 16, 16)
    with pytest.raises(ConfigError, match="max_kv_share"):
        RequestLimits(max_kv_share=0)


# -- issue 42, items 4, 6 and 7 ------------------------------------------------------------------
def test_a_deeply_nested_body_is_400_and_logs_nothing(tiny_server, caplog):
    with caplog.at_level(logging.ERROR), httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        for depth in (100_000, 65):
            r = c.post(
                "/v1/completions", content="[" * depth + "]" * depth, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400 and "nested more than 64 levels" in r.json()["error"]["message"], r.text
        deep = {"prompt": "x", "max_tokens": 2, "logit_bias": {"5": 1}, "user": "u"}
        for _ in range(70):
            deep = {"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": deep}}
        assert c.post("/v1/completions", json=deep).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("stop", ['"\\ud800"', '["ok", "a\\udfffb"]'])
def test_a_lone_surrogate_in_stop_is_400(tiny_server, stop):
    raw = f'{{"prompt": "hello", "max_tokens": 2, "stop": {stop}}}'.encode()
    r = httpx.post(tiny_server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "not valid UTF-8" in r.json()["error"]["message"]


def test_an_api_key_in_the_query_string_is_never_logged(tiny_model, chat_tokenizer):
    from fastdecode.server.shutdown import make_server

    app = create_app(Engine(tiny_model, chat_tokenizer, max_num_seqs=1), model_name="tiny", api_key="right-key")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = make_server(app, log_level="info")  # uvicorn's access log on
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    access.addHandler(keep := Keep())
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(url + "/v1/models?api_key=secret-in-the-query").status_code == 401
        ok = httpx.get(url + "/v1/models?api_key=another-secret", headers={"Authorization": "Bearer right-key"})
        assert ok.status_code == 200
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        access.removeHandler(keep)
    assert any("GET /v1/models HTTP/1.1" in line and "401" in line for line in lines), lines
    assert not any("secret" in line or "?" in line for line in lines), lines
