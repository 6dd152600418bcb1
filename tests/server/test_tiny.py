"""Serving behaviour on the tiny model: concurrency, n, chat through a template, and the
transformers backend (one request at a time, the others queued)."""

from __future__ import annotations

import asyncio

import httpx

from fastdecode.backends import make_target
from fastdecode.engine import Engine
from fastdecode.server.app import create_app
from fastdecode.server.limits import RequestLimits


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))


def greedy(prompt: str, max_tokens: int = 12, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_concurrent_requests_get_their_alone_outputs(tiny_server):
    prompts = [f"prompt {i}: " + "xyz"[i % 3] * (i + 1) for i in range(10)]
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        alone = [c.post("/v1/completions", json=greedy(p)).json()["choices"][0]["text"] for p in prompts]
    together = asyncio.run(_post_all(tiny_server.url, [greedy(p) for p in prompts]))
    assert [r.json()["choices"][0]["text"] for r in together] == alone
    assert len({r.json()["id"] for r in together}) == len(prompts)


def test_several_prompts_and_n_in_one_request(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        body = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "temperature": 0.9, "seed": 3}
        r = c.post("/v1/completions", json=body).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        # Choice (prompt p, i) samples with seed 3 + i.
        for index, (prompt, seed) in enumerate([("ab", 3), ("ab", 4), ("cd", 3), ("cd", 4)]):
            single = c.post("/v1/completions", json={**body, "prompt": prompt, "n": 1, "seed": seed}).json()
            assert r["choices"][index]["text"] == single["choices"][0]["text"]
        assert r["usage"]["prompt_tokens"] == 3 + 3  # each prompt once (bos + 2 characters)
        assert r["usage"]["completion_tokens"] == sum(ch["fastdecode"] is not None for ch in r["choices"]) * 5


def test_chat_goes_through_the_template(tiny_server, chat_tokenizer):
    messages = [{"role": "system", "content": "be short"}, {"role": "user", "content": "hi"}]
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
        rendered = "system: be short | user: hi | assistant: "
        assert r["usage"]["prompt_tokens"] == len(rendered)  # the template's text, no special tokens added
        raw = c.post(
            "/v1/completions",
            json={"prompt": [chat_tokenizer.char_to_id[ch] for ch in rendered], "max_tokens": 6, "temperature": 0},
        ).json()
        assert r["choices"][0]["message"]["content"] == raw["choices"][0]["text"]


def test_transformers_backend_serves_one_at_a_time(tiny_model, chat_tokenizer, serve_app):
    engine = Engine(tiny_model, chat_tokenizer, target=make_target(tiny_model, "hf"))
    native = Engine(tiny_model, chat_tokenizer)
    prompts = ["hello", "world", "again"]
    expected = [r.text for r in native.generate(prompts, chat=False, max_new_tokens=8)]
    with serve_app(create_app(engine, model_name="tiny")) as server:
        responses = asyncio.run(_post_all(server.url, [greedy(p, 8) for p in prompts]))
        models = httpx.get(server.url + "/v1/models").json()["data"][0]["fastdecode"]
    assert models["backend"] == "hf" and models["max_num_seqs"] == 1
    assert [r.json()["choices"][0]["text"] for r in responses] == expected


def test_kv_policy_per_request_goes_past_the_context(tiny_model, chat_tokenizer, serve_app):
    # past the context only where the operator allows a request more new tokens than the context
    # (--max-request-tokens; its default, the context, clamps max_tokens to 128 and says so)
    engine = Engine(tiny_model, chat_tokenizer, max_num_seqs=4)
    app = create_app(engine, model_name="tiny", limits=RequestLimits(max_request_tokens=1000))
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        full = c.post("/v1/completions", json=greedy("xyz", max_tokens=200)).json()
        sinks = c.post("/v1/completions", json=greedy("xyz", max_tokens=200, kv_policy="sinks")).json()
        bad = c.post("/v1/completions", json=greedy("xyz", kv_policy="lru"))
    context = 128  # the tiny model's (tests/conftest.py)
    assert full["usage"]["total_tokens"] == context  # stopped at the context
    assert sinks["usage"]["completion_tokens"] == 200 and sinks["usage"]["total_tokens"] > context
    assert sinks["choices"][0]["text"].startswith(full["choices"][0]["text"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_policy"


def test_max_tokens_beyond_the_request_limit_is_clamped_and_says_so(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        r = c.post("/v1/completions", json=greedy("xyz", max_tokens=200, kv_policy="sinks"))
    assert r.status_code == 200, r.text
    clamped = r.json()["fastdecode"]["clamped"]["max_tokens"]
    assert clamped["requested"] == 200 and clamped["granted"] == 128 and "--max-request-tokens" in clamped["limit"]
    assert r.json()["usage"]["completion_tokens"] == 128 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.headers["X-Fastdecode-Clamped"].startswith("max_tokens=128; requested=200")
