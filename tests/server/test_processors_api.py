"""Penalties, logit_bias, min_tokens and response_format through the server: the same tokens
as the engine with the same settings, speculative or not; JSON that validates; bad settings
are a 400 in OpenAI's schema and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.server.app import create_app
from fastdecode.server.limits import RequestLimits

VOCAB = 128  # "}" is in the character tokenizer's range
PAD_ID, BOS_ID, EOS_ID, CONTEXT_LENGTH = 0, 1, 2, 128  # the tests' tiny models (tests/conftest.py)
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["s", "m", "xl"]},
        "n": {"type": "integer", "maximum": 99},
    },
    "required": ["ok", "size", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "give me json"}]


@pytest.fixture(scope="module")
def server(serve_app, chat_tokenizer):
    model = tiny_llama(
        0,
        vocab_size=VOCAB,
        max_position_embeddings=CONTEXT_LENGTH,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        pad_token_id=PAD_ID,
    )
    tokenizer = type(chat_tokenizer)(vocab_size=VOCAB, eos_token_id=EOS_ID)  # the chat template's class
    tokenizer.chat_template = chat_tokenizer.chat_template
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram", n=2, k=4), max_num_seqs=4)
    # n=4 JSON answers of up to 60 tokens: more than the default limits grant on a 128-token context
    limits = RequestLimits(max_request_tokens=4 * CONTEXT_LENGTH, max_kv_share=1.0)
    with serve_app(create_app(engine, model_name="tiny", limits=limits)) as s:
        s.engine = engine
        yield s


def _post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return c.post(path, json=body)


def test_penalties_and_bias_are_the_engines_speculative_or_not(server):
    settings = {
        "frequency_penalty": 0.9,
        "presence_penalty": 0.4,
        "repetition_penalty": 1.3,
        "logit_bias": {"40": 3},
        "min_tokens": 4,
    }
    body = {"prompt": [1, 20, 21, 22, 23, 20, 21, 22], "max_tokens": 24, "temperature": 0, **settings}
    spec = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    plain = _post(server, "/v1/completions", {**body, "speculate": False}).json()["choices"][0]["text"]
    bare = _post(server, "/v1/completions", {"prompt": body["prompt"], "max_tokens": 24, "temperature": 0}).json()
    assert spec == plain != bare["choices"][0]["text"]
    options = {**settings, "logit_bias": {40: 3.0}}
    alone = Engine(server.engine.model, server.engine.tokenizer).generate(body["prompt"], max_new_tokens=24, **options)
    assert spec == alone.text


@pytest.mark.parametrize("speculate", [True, False])
def test_json_schema_responses_validate(server, speculate):
    jsonschema = pytest.importorskip("jsonschema")
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    body = {
        "messages": MESSAGES,
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 3,
        "n": 4,
        "response_format": response_format,
        "speculate": speculate,
    }
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_regex_response_format_and_the_openai_client(server):
    r = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 20,
            "temperature": 0,
            "response_format": {"type": "regex", "regex": "(yes|no), [0-9]{1,3}"},
        },
    )
    import re

    assert re.fullmatch("(yes|no), [0-9]{1,3}", r.json()["choices"][0]["message"]["content"])
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        out = c.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=60,
            temperature=0,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logit_bias={"41": -100},
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
            logprobs=True,
            top_logprobs=2,
        )
        json.loads(out.choices[0].message.content)
        assert all(t.logprob > -9999 for t in out.choices[0].logprobs.content)


BAD = [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
    (
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
            },
        },
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": {"type": "regex", "regex": "[0-"}},
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_settings_are_400_and_the_server_keeps_serving(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param or param is None
    ok = _post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2})
    assert ok.status_code == 200
