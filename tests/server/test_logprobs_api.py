"""Log-probabilities and echo through the server (the tiny model): OpenAI's and vLLM's formats,
the target's values whatever the drafter, and the ``openai`` client's own types."""

from __future__ import annotations

import httpx
import pytest
import torch

from fastdecode import Engine, build_drafter
from fastdecode.server.app import create_app

PROMPT = [1, 20, 21, 22, 23, 20, 21, 22]


def _post(url: str, path: str, body: dict) -> dict:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_gives_prompt_logprobs_in_vllms_format(tiny_server, tiny_model, chat_tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    r = _post(tiny_server.url, "/v1/completions", body)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    n = len(PROMPT) + 3
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(lp[k]) == n for k in lp)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][: len(PROMPT)] == [chat_tokenizer.decode([t]) for t in PROMPT]
    assert choice["text"].startswith(chat_tokenizer.decode(PROMPT))
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    with torch.inference_mode():
        logp = torch.log_softmax(tiny_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for i in range(1, len(PROMPT)):
        assert lp["token_logprobs"][i] == pytest.approx(float(logp[i - 1, PROMPT[i]]), abs=1e-4)
        top = lp["top_logprobs"][i]
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(float(logp[i - 1].max()), abs=1e-4)
    # lm-evaluation-harness's greedy check: a greedy token's logprob is the top one
    for value, top in zip(lp["token_logprobs"][len(PROMPT) :], lp["top_logprobs"][len(PROMPT) :]):
        assert value == max(top.values())


def test_echo_without_logprobs_and_streamed(tiny_server):
    plain = _post(tiny_server.url, "/v1/completions", {"prompt": "ab", "max_tokens": 4, "temperature": 0})
    echo = _post(tiny_server.url, "/v1/completions", {"prompt": "ab", "max_tokens": 4, "temperature": 0, "echo": True})
    assert echo["choices"][0]["text"] == "ab" + plain["choices"][0]["text"]
    assert echo["choices"][0]["logprobs"] is None
    body = {"prompt": "ab", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1, "stream": True}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    import json

    choices = [json.loads(ch)["choices"][0] for ch in chunks]
    assert "".join(ch["text"] for ch in choices) == echo["choices"][0]["text"]
    tokens = sum((ch["logprobs"]["tokens"] for ch in choices if ch["logprobs"]), [])
    assert len(tokens) == 3 + 4  # bos, a, b and the four new tokens
    offsets = sum((ch["logprobs"]["text_offset"] for ch in choices if ch["logprobs"]), [])
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_logprobs_are_the_targets_whatever_the_drafter(tiny_model, chat_tokenizer, serve_app, tiny_server, drafter):
    from tiny_models import tiny_llama

    options = {"model": tiny_llama(7)} if drafter == "draft-model" else {}
    engine = Engine(tiny_model, chat_tokenizer, drafter=build_drafter(drafter, k=3, **options), max_num_seqs=2)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    with serve_app(create_app(engine, model_name="tiny")) as server:
        spec = _post(server.url, "/v1/completions", body)["choices"][0]
    plain = _post(tiny_server.url, "/v1/completions", body)["choices"][0]
    assert spec["text"] == plain["text"]
    assert spec["logprobs"]["tokens"] == plain["logprobs"]["tokens"]
    assert spec["logprobs"]["token_logprobs"] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)


def test_chat_logprobs_in_openais_chat_format(tiny_server):
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = _post(tiny_server.url, "/v1/chat/completions", body)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] == entry["top_logprobs"][0]["logprob"]
        assert entry["bytes"] == list(entry["token"].encode())
    without = _post(tiny_server.url, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert without["choices"][0]["logprobs"] is None


def test_the_openai_client_parses_logprobs_with_n(tiny_server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        r = c.completions.create(
            model="tiny", prompt="abc", max_tokens=4, n=2, temperature=0.9, seed=1, echo=True, logprobs=2
        )
        assert len(r.choices) == 2
        for choice in r.choices:
            lp = choice.logprobs
            assert lp.token_logprobs[0] is None and len(lp.tokens) == 4 + 4
            assert all(isinstance(t, dict) for t in lp.top_logprobs[1:]) and len(lp.text_offset) == 8
        chat = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            n=2,
            temperature=0.9,
            seed=2,
            logprobs=True,
            top_logprobs=3,
        )
        for choice in chat.choices:
            assert 1 <= len(choice.logprobs.content) <= 4  # (a sampled end-of-sequence may come early)
            assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


def test_streamed_chat_logprobs_add_up_to_the_whole(tiny_server):
    import json

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = _post(tiny_server.url, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    with (
        httpx.Client(base_url=tiny_server.url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = sum((ch["choices"][0]["logprobs"]["content"] for ch in chunks if ch["choices"][0]["logprobs"]), [])
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole])


def test_best_of_returns_the_n_most_likely_per_token(tiny_server):
    body = {"prompt": ["ab", "cd"], "max_tokens": 6, "temperature": 1.0, "seed": 5}
    every = _post(tiny_server.url, "/v1/completions", {**body, "n": 4, "logprobs": 0})["choices"]
    best = _post(tiny_server.url, "/v1/completions", {**body, "n": 2, "best_of": 4})
    assert [c["index"] for c in best["choices"]] == [0, 1, 2, 3]
    assert best["choices"][0]["logprobs"] is None  # not asked for
    assert best["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in every)
    for p in range(2):
        group = every[4 * p : 4 * p + 4]
        ranked = sorted(group, key=lambda c: -sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["tokens"]))
        assert [c["text"] for c in best["choices"][2 * p : 2 * p + 2]] == [c["text"] for c in ranked[:2]]
