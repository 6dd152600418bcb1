"""The server probed as an attacker and a careless client would: a foreign Host header (DNS
rebinding), a text/plain POST (a cross-site form), an oversized body, a lone surrogate in
chat content, an empty prompt. Each gets one error in OpenAI's schema, and the server keeps
serving. (Shutdown with requests running: test_shutdown.py.)"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from fastdecode.engine import Engine
from fastdecode.server.app import create_app
from fastdecode.server.guards import allowed_hosts_for, host_matches, normalize_host
from fastdecode.util.commands import UsageError

GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def assert_error(response: httpx.Response, status: int, code=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


def assert_still_serving(client) -> None:
    r = client.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


# -- Host allow-list -------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_foreign_host_header_is_refused(client, tiny_server, host):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/"), ("GET", "/metrics")):
        r = client.request(method, path, json=GOOD if method == "POST" else None, headers={"Host": host})
        assert "--allowed-hosts" in assert_error(r, 400, code="host_not_allowed")["message"]
    assert_still_serving(client)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:8000", "localhost."])
def test_loopback_names_are_served(client, host):
    r = client.post("/v1/completions", json=GOOD, headers={"Host": host})
    assert r.status_code == 200, r.text


def test_a_request_without_a_host_header_is_refused(tiny_server):
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        reply = s.makefile("rb").read().decode()
    assert reply.startswith("HTTP/1.1 400") and '"host_not_allowed"' in reply


def test_allowed_hosts_patterns():
    hosts = allowed_hosts_for("0.0.0.0", ["api.example.com", "*.corp.example", "::2"])
    assert hosts == ["localhost", "127.0.0.1", "[::1]", "0.0.0.0", "api.example.com", "*.corp.example", "[::2]"]
    assert host_matches(normalize_host("API.example.com:443"), hosts)
    assert host_matches(normalize_host("gpu1.corp.example"), hosts)
    assert host_matches(normalize_host("[::2]:80"), hosts)
    assert not host_matches(normalize_host("corp.example.evil"), hosts)
    assert not host_matches(normalize_host("example.com"), hosts)
    assert host_matches("anything", ["*"])


def test_allowed_hosts_widen_the_list(tiny_model, chat_tokenizer, serve_app):
    engine = Engine(tiny_model, chat_tokenizer, max_num_seqs=1)
    app = create_app(engine, model_name="tiny", allowed_hosts=[*allowed_hosts_for(None), "*.example.com"])
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/v1/models", headers={"Host": "gpu.example.com"}).status_code == 200
        assert_error(c.get("/v1/models", headers={"Host": "example.org"}), 400, code="host_not_allowed")
    app = create_app(Engine(tiny_model, chat_tokenizer, max_num_seqs=1), model_name="tiny", allowed_hosts=["*"])
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/v1/models", headers={"Host": "anything.example.org"}).status_code == 200


def test_serve_flags_for_hosts_and_the_body_cap():
    from fastdecode.cli.commands import build_parser

    args = build_parser().parse_args(
        ["serve", "--allowed-hosts", "a.example,*.b.example", "--allowed-hosts", "*", "--max-request-bytes", "1000"]
    )
    assert args.allowed_hosts == ["a.example", "*.b.example", "*"] and args.max_request_bytes == 1000
    assert build_parser().parse_args(["serve"]).allowed_hosts == []
    for bad in (["--allowed-hosts", "a.*.example"], ["--allowed-hosts", "*example"], ["--max-request-bytes", "0"]):
        with pytest.raises(UsageError):
            build_parser().parse_args(["serve", *bad])


# -- JSON bodies only ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_post_that_is_not_json_is_415(client, path, content_type):
    body = json.dumps(GOOD if path == "/v1/completions" else CHAT).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    request = client.build_request("POST", path, content=body, headers=headers)
    assert request.headers.get("Content-Type") == content_type
    assert_error(client.send(request), 415, code="unsupported_media_type")
    assert_still_serving(client)


def test_json_with_parameters_is_accepted(client):
    headers = {"Content-Type": "application/json; charset=utf-8"}
    r = client.post("/v1/completions", content=json.dumps(GOOD).encode(), headers=headers)
    assert r.status_code == 200, r.text


# -- the body-size cap -------------------------------------------------------------------------
def test_a_declared_50_mb_body_is_413_before_it_is_sent(tiny_server, client):
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=10) as s:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * 2**20}\r\nConnection: close\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"prompt": "')  # and nothing more: the answer must not wait for the body
        reply = s.makefile("rb").read().decode()
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    body = json.loads(reply.split("\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large" and "--max-request-bytes" in body["error"]["message"]
    assert_still_serving(client)


def test_an_undeclared_body_is_cut_off_at_the_cap_without_being_read(tiny_model, chat_tokenizer):
    """A chunked body (no Content-Length) of unbounded length: the app reads at most the cap
    plus one chunk, then answers 413 (driven at the ASGI level to count what was read)."""
    limit, chunk = 2**20, b"x" * 2**16
    app = create_app(Engine(tiny_model, chat_tokenizer, max_num_seqs=1), model_name="tiny", max_request_bytes=limit)
    read, sent = [0], []

    async def receive():
        read[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}  # never ends

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert read[0] <= limit + len(chunk)


def test_max_request_bytes_is_configurable(tiny_model, chat_tokenizer, serve_app):
    app = create_app(Engine(tiny_model, chat_tokenizer, max_num_seqs=1), model_name="tiny", max_request_bytes=200)
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/completions", json=GOOD).status_code == 200
        assert_error(c.post("/v1/completions", json={**GOOD, "prompt": "x" * 300}), 413, code="request_too_large")
        assert c.post("/v1/completions", json=GOOD).status_code == 200


# -- prompts: one rule (tests/decoding/test_prompt_rules.py has the engine's side) ----------------------
@pytest.mark.parametrize(
    "path, raw",
    [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfffb"}]}]}',
        ),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ],
)
def test_a_lone_surrogate_is_400_not_500(client, path, raw):
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert "not valid UTF-8" in assert_error(r, 400)["message"]
    assert_still_serving(client)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": ["hello", ""]}),
        ("/v1/completions", {"prompt": [[1, 2], []]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": ""}], "stream": True},
        ),
    ],
)
def test_an_empty_prompt_is_400(client, path, body):
    """The same words as the engine's and the CLI's (fastdecode.decoding.tokenization.EMPTY_PROMPT)."""
    r = client.post(path, json={**body, "max_tokens": 2})
    assert assert_error(r, 400)["message"].startswith("the prompt is empty")
    assert_still_serving(client)
