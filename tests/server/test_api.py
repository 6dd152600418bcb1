"""The real ``openai`` client against ``fastdecode serve``'s app on the embedded model
(SmolLM2-135M-Instruct, n-gram drafter, on 127.0.0.1 on a free port)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

# openai is imported by the fixture and test that use it (all integration tests: collecting
# this module, as the unit run does before deselecting it, imports none of it)


MODEL = "smollm2-135m"
PROMPT = "Write one sentence about the sea."  # conftest.REFERENCE_PROMPT
REFERENCE_MAX_TOKENS = 24
COPY_PROMPT = "Repeat this line twice: the quick brown fox jumps over the lazy dog."


@pytest.fixture
def client(embedded_server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=embedded_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client, content=PROMPT, **kwargs):
    kwargs = {"max_tokens": 24, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons per choice index, and the chunks, from a chat or completions stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_chat_greedy_equals_fastdecode_generate(client, embedded_server):
    reference = embedded_server.reference.to_dict()  # Engine.generate, plain decoding (conftest)
    assert reference["num_new_tokens"] == REFERENCE_MAX_TOKENS and reference["drafter"] == "none"
    response = chat(client)  # the server speculates with the n-gram drafter; the CLI decodes plainly
    assert response.choices[0].message.content == reference["text"]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == {"eos": "stop", "length": "length"}[reference["finish_reason"]]
    assert response.usage.prompt_tokens == reference["num_prompt_tokens"]
    assert response.usage.completion_tokens == reference["num_new_tokens"]
    assert response.usage.total_tokens == reference["num_prompt_tokens"] + reference["num_new_tokens"]
    assert response.model == MODEL and response.object == "chat.completion"

    texts, finish, chunks = stream_text(chat(client, stream=True))
    assert texts == {0: reference["text"]} and finish == {0: response.choices[0].finish_reason}
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_completions_stream_and_not_and_without_speculation(client, embedded_server):
    tokenizer = embedded_server.engine.tokenizer
    prompt = "The three primary colors are"
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"speculate": False}
    )
    spec = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert spec.choices[0].text == plain.choices[0].text
    assert plain.to_dict()["fastdecode"]["drafter"] == "none"
    assert plain.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])  # raw text: no chat template
    texts, finish, chunks = stream_text(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert texts == {0: plain.choices[0].text} and finish == {0: plain.choices[0].finish_reason}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude_none=True) == spec.usage.model_dump(
        exclude_none=True
    )


def test_stop_strings(client):
    full = chat(client, max_tokens=32).choices[0].message.content
    words = re.findall(r"[A-Za-z]{4,}", full)
    assert len(words) >= 3, full
    stop = words[2]
    cut = full[: full.index(stop)]
    for stop_arg in (stop, ["NEVER-SEEN", stop]):
        response = chat(client, max_tokens=32, stop=stop_arg)
        assert response.choices[0].message.content == cut
        assert response.choices[0].finish_reason == "stop"
    texts, finish, _ = stream_text(chat(client, max_tokens=32, stop=[stop], stream=True))
    assert texts == {0: cut} and finish == {0: "stop"}


def test_seeded_sampling_is_reproducible_and_n_gives_seed_plus_i(client):
    sampled = dict(temperature=1.0, top_p=0.95, max_tokens=16)
    singles = [chat(client, seed=s, **sampled) for s in (7, 8, 9)]
    texts = [r.choices[0].message.content for r in singles]
    assert texts[0] != texts[1]  # 16 tokens at temperature 1: the same text from two seeds would be a bug

    # n=3 with seed 7: choice i samples with seed 7 + i, so it reproduces the single requests.
    many = chat(client, seed=7, n=3, **sampled)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert [ch.message.content for ch in many.choices] == texts
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)

    streamed, finish, _ = stream_text(chat(client, seed=7, n=3, stream=True, **sampled))
    assert streamed == dict(enumerate(texts))
    assert finish == {i: ch.finish_reason for i, ch in enumerate(many.choices)}


def test_usage_and_acceptance_figures(client, embedded_server):
    tokenizer = embedded_server.engine.tokenizer
    messages = [{"role": "system", "content": "You copy text exactly."}, {"role": "user", "content": COPY_PROMPT}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(tokenizer(template, add_special_tokens=False)["input_ids"])
    figures = response.to_dict()["fastdecode"]
    choice_figures = response.choices[0].to_dict()["fastdecode"]
    assert figures["drafter"] == "ngram"
    assert 0 < figures["accepted_tokens"] <= figures["drafted_tokens"]  # the n-gram drafter copies the prompt
    assert figures["tau"] > 1.0
    assert choice_figures["drafted_tokens"] == figures["drafted_tokens"]
    assert figures["acceptance_rate"] == pytest.approx(figures["accepted_tokens"] / figures["drafted_tokens"])
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_body={"speculate": False}
    )
    assert plain.choices[0].message.content == response.choices[0].message.content
    assert plain.to_dict()["fastdecode"] == {
        "drafter": "none",
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "acceptance_rate": 0.0,
        "tau": 1.0,
    }

    # Streaming: the per-chunk figures add up to the final ones.
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    live = [c.to_dict()["fastdecode"] for c in chunks if c.choices and "fastdecode" in c.to_dict()]
    assert sum(f["tokens"] for f in live) == response.usage.completion_tokens
    assert sum(f["drafted"] for f in live) == figures["drafted_tokens"]
    assert sum(f["accepted"] for f in live) == figures["accepted_tokens"]
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    assert chunks[-1].to_dict()["fastdecode"] == figures


def test_models_and_unknown_model(client):
    import openai

    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text (labels other than model_name as given)."""
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)\{(.*)\} (\S+)$", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) == want:
            return float(m.group(3))
    return 0.0


def test_metrics_names(client, embedded_server):
    chat(client, COPY_PROMPT)
    text = httpx.get(embedded_server.url + "/metrics").text
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "spec_decode_num_drafts_total",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "spec_decode_num_accepted_tokens_per_pos_total",
    ]:
        assert re.search(rf"^fastdecode:{name}\{{", text, re.M), name
    assert metric(text, "fastdecode:generation_tokens_total") > 0
    assert metric(text, "fastdecode:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric(text, "fastdecode:spec_decode_num_accepted_tokens_total") >= metric(
        text, "fastdecode:spec_decode_num_accepted_tokens_per_pos_total", position="1"
    )


def test_disconnect_mid_stream_aborts_and_frees_the_kv_cache(embedded_server):
    url = embedded_server.url
    before = httpx.get(url + "/metrics").text
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    contents = 0
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                contents += 1
                if contents == 3:
                    mid = httpx.get(url + "/metrics").text
                    assert metric(mid, "fastdecode:num_requests_running") == 1
                    assert metric(mid, "fastdecode:kv_cache_usage_perc") > 0
                    break  # (leaving iter_lines early closes the connection)
    # The client is gone: the request is aborted and its blocks freed.
    deadline = time.monotonic() + 30
    while True:
        after = httpx.get(url + "/metrics").text
        aborted = metric(after, "fastdecode:request_success_total", finished_reason="abort") - metric(
            before, "fastdecode:request_success_total", finished_reason="abort"
        )
        if aborted == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert aborted == 1
    assert metric(after, "fastdecode:num_requests_running") == 0
    assert metric(after, "fastdecode:kv_cache_usage_perc") == 0.0
    generated = metric(after, "fastdecode:generation_tokens_total") - metric(
        before, "fastdecode:generation_tokens_total"
    )
    assert 3 <= generated < 400
