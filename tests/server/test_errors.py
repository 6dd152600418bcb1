"""Bad requests over HTTP on the tiny model: each gets its status and OpenAI's error schema,
no traceback, and the server keeps serving (a good request right after succeeds)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from fastdecode.engine import Engine
from fastdecode.server.app import create_app

GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0}


def assert_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def good_text(client):
    r = client.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def long_prompt(n: int) -> str:
    return "ab" * (n // 2)


BAD = [
    # (path, raw body, status, param, code)
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, None, None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n", None),
    ("/v1/completions", {"prompt": 42}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [5, 100000]}, 400, None, None),  # outside the vocabulary
    ("/v1/completions", {"prompt": long_prompt(200)}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2]}, 400, "stop_token_ids", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": True}, 400, "ignore_eos", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "min_p": 0.1}, 400, "min_p", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
        400,
        "top_logprobs",
        None,
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": long_prompt(200)}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "top_k": -5},
        400,
        "top_k",
        None,
    ),
    ("/v1/nothing-here", {"prompt": "x"}, 404, None, None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD)
def test_bad_request_then_a_good_one(client, good_text, path, body, status, param, code):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert_error(r, status, param, code)
    r = client.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == good_text


def test_wrong_method_is_405_in_the_error_schema(client):
    assert_error(client.get("/v1/completions"), 405)


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 128


# -- the API key ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(tiny_model, tokenizer, serve_app):
    """The tiny model with the plain character tokenizer (no chat template), behind a key."""
    engine = Engine(tiny_model, tokenizer, max_num_seqs=2)
    with serve_app(create_app(engine, model_name="tiny", api_key="s3cret-kéy")) as server:
        yield server


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "s3cret"},
        {"Authorization": "Basic czNjcmV0"},
        {"Authorization": "Bearer s3cret-k"},
    ],
)
def test_missing_or_wrong_key_is_401(keyed_server, headers):
    with httpx.Client(base_url=keyed_server.url, timeout=30) as c:
        assert_error(c.post("/v1/completions", json=GOOD, headers=headers), 401, code="invalid_api_key")
        assert_error(c.get("/v1/models", headers=headers), 401)
        assert c.get("/health").status_code == 200  # open


def test_right_key_is_served(keyed_server):
    key = "s3cret-kéy".encode()
    with httpx.Client(base_url=keyed_server.url, timeout=30, headers={"Authorization": b"Bearer " + key}) as c:
        r = c.post("/v1/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # A model without a chat template refuses chat, in the error schema.
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert "chat template" in assert_error(r, 400)["message"]


# -- a full waiting queue -------------------------------------------------------------------
class SlowEngine(Engine):
    """Steps take at least 10 ms, so that requests overlap."""

    def step(self):
        time.sleep(0.01)
        return super().step()


def test_full_waiting_queue_is_503_with_retry_after(tiny_model, chat_tokenizer, serve_app):
    engine = SlowEngine(tiny_model, chat_tokenizer, max_num_seqs=1)
    body = {"prompt": "hello", "max_tokens": 30, "temperature": 0}

    async def fire(url, count):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(count)))

    with serve_app(create_app(engine, model_name="tiny", max_waiting=1)) as server:
        responses = asyncio.run(fire(server.url, 12))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503}
        assert statuses.count(503) >= 1 and statuses.count(200) >= 2  # one running and one waiting fit
        for r in responses:
            if r.status_code == 503:
                assert_error(r, 503, code="queue_full")
                assert int(r.headers["Retry-After"]) >= 1
        texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
        assert len(texts) == 1  # the same greedy text for each
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] in texts


# -- the engine itself failing ---------------------------------------------------------------
class FlakyEngine(Engine):
    """``step`` raises while ``fail`` is set (a stand-in for a bug in the engine)."""

    fail = threading.Event()

    def step(self):
        if self.fail.is_set():
            self.fail.clear()
            raise RuntimeError("boom: secret internals")
        return super().step()


def test_an_engine_error_is_500_without_details_and_the_server_recovers(tiny_model, chat_tokenizer, serve_app):
    engine = FlakyEngine(tiny_model, chat_tokenizer, max_num_seqs=2)
    with serve_app(create_app(engine, model_name="tiny")) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        FlakyEngine.fail.set()
        r = c.post("/v1/completions", json=GOOD)
        assert "boom" not in assert_error(r, 500)["message"]
        FlakyEngine.fail.set()
        with c.stream("POST", "/v1/completions", json={**GOOD, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "boom" not in error["message"]
        r = c.post("/v1/completions", json=GOOD)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert c.get("/health").status_code == 200


def test_a_client_gone_before_its_response_is_aborted(tiny_model, chat_tokenizer, serve_app):
    engine = SlowEngine(tiny_model, chat_tokenizer, max_num_seqs=2)
    body = {"prompt": "hello", "max_tokens": 110, "temperature": 0}  # >= 1.1 s at 10 ms a step
    with serve_app(create_app(engine, model_name="tiny")) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.4)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(server.url + "/metrics").text
            if 'request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text:
                break
            time.sleep(0.05)
        assert 'request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text
        assert 'fastdecode:num_requests_running{model_name="tiny"} 0.0' in text
        assert 'fastdecode:kv_cache_usage_perc{model_name="tiny"} 0.0' in text
        assert 'request_success_total{finished_reason="length"' not in text
