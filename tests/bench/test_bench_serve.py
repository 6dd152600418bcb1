"""``fastdecode bench-serve``: its statistics on hand-made timelines, its SSE parsing on canned
streams, and the command end to end against ``fastdecode serve`` on a tiny random-weight model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil

import httpx
import pytest

from fastdecode.bench.serve_client import Endpoint, stream_request
from fastdecode.bench.serve_results import (
    RequestRecord,
    ServeRun,
    compare,
    inter_token_latencies,
    spread_evenly,
    summarize,
)
from fastdecode.bench.serve_servers import free_port
from fastdecode.cli import main

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# 9 distinct prompts: the warm-up's, then 4 for each of two concurrency levels (none sent twice).
PROMPTS = [
    "The sea is",
    "Count: 1 2 3",
    "def add(a, b):",
    "Hello there, how",
    "Once upon a time",
    "Rain falls on",
    "x = [1, 2,",
    "Good morning to",
    "Three small birds",
]


def record(
    ttft=0.1,
    times=(0.1, 0.2, 0.3),
    tokens=3,
    chunk_tokens=None,
    e2e=0.3,
    text="abc",
    error=None,
    server="fastdecode",
    c=1,
    i=0,
) -> RequestRecord:
    return RequestRecord(
        server=server,
        concurrency=c,
        prompt_index=i,
        ttft_s=ttft,
        e2e_s=e2e,
        chunk_times_s=list(times),
        chunk_tokens=chunk_tokens,
        output_tokens=tokens,
        tokens_counted_by="usage",
        finish_reason="length",
        text=text,
        error=error,
    )


# ---------------------------------------------------------------- statistics


def test_spread_evenly():
    assert spread_evenly(10, 4) == [3, 3, 2, 2]
    assert spread_evenly(3, 3) == [1, 1, 1]
    assert spread_evenly(5, 0) == []


def test_itl_spreads_each_gap_over_the_tokens_its_chunk_carried():
    # chunks at 0.5, 0.6, 0.9 s with 1, 1, 3 tokens: the 0.3 s gap is three 0.1 s ITLs
    assert inter_token_latencies([0.5, 0.6, 0.9], [1, 1, 3]) == pytest.approx([0.1] * 4)
    # the first chunk's tokens are TTFT, not ITL; an empty chunk gives none
    assert inter_token_latencies([0.5, 0.7], [4, 2]) == pytest.approx([0.1, 0.1])
    assert inter_token_latencies([0.5, 0.7, 0.8], [1, 0, 1]) == pytest.approx([0.1])
    assert inter_token_latencies([0.5], [1]) == []


def test_summarize_a_hand_made_run():
    records = [
        # 5 tokens in 3 chunks (the server said 1, 2, 2): ITLs 0.1/2 x2 and 0.2/2 x2
        record(ttft=0.2, times=(0.2, 0.3, 0.5), tokens=5, chunk_tokens=[1, 2, 2], e2e=0.6, i=0),
        # 4 tokens in 4 chunks, no per-chunk counts: one token each, ITLs 0.1 s
        record(ttft=0.4, times=(0.4, 0.5, 0.6, 0.7), tokens=4, e2e=0.7, i=1),
        record(ttft=None, times=(), tokens=None, e2e=0.05, text="", error="HTTP 503: busy", i=2),
    ]
    run = summarize("fastdecode", 2, num_requests=4, records=records, wall_s=2.0, complete=False)
    assert (run.completed, run.errors, run.cancelled, run.output_tokens) == (2, 1, 1, 9)
    assert run.output_tokens_per_s == pytest.approx(4.5) and run.requests_per_s == pytest.approx(1.0)
    assert run.ttft_p50_s == pytest.approx(0.3) and run.ttft_p99_s == pytest.approx(0.2 + 0.2 * 0.99)
    # ITLs: 0.05, 0.05, 0.1, 0.1, 0.1, 0.1, 0.1 -> p50 0.1
    assert run.itl_p50_s == pytest.approx(0.1)
    # TPOT: (0.6 - 0.2) / 4 = 0.1 and (0.7 - 0.4) / 3 = 0.1
    assert run.tpot_mean_s == pytest.approx(0.1)
    assert run.first_error == "HTTP 503: busy" and not run.complete


def _run(server, c, tps, ttft_p99) -> ServeRun:
    return ServeRun(
        server=server,
        concurrency=c,
        num_requests=2,
        completed=2,
        errors=0,
        cancelled=0,
        output_tokens=10,
        wall_s=1.0,
        output_tokens_per_s=tps,
        requests_per_s=2.0,
        ttft_p50_s=0.1,
        ttft_p99_s=ttft_p99,
        itl_p50_s=0.01,
        itl_p99_s=0.02,
        tpot_mean_s=0.01,
        tokens_counted_by="usage",
        complete=True,
    )


def test_compare_gives_ratios_and_text_agreement_per_concurrency():
    runs = [
        _run("fastdecode", 1, 30.0, 0.2),
        _run("llama-cpp", 1, 15.0, 0.4),
        _run("fastdecode", 8, 100.0, 0.5),
        _run("llama-cpp", 8, 40.0, 0.25),
        _run("fastdecode", 16, 120.0, 0.5),
    ]  # C=16: no peer run, no row
    records = [
        record(server="fastdecode", c=1, i=0, text="same"),
        record(server="llama-cpp", c=1, i=0, text="same"),
        record(server="fastdecode", c=1, i=1, text="x"),
        record(server="llama-cpp", c=1, i=1, text="y"),
        record(server="fastdecode", c=8, i=0, text="z"),
        record(server="llama-cpp", c=8, i=0, error="timed out"),
    ]
    rows = compare(runs, records)
    assert [r.concurrency for r in rows] == [1, 8]
    assert rows[0].output_tokens_per_s_ratio == pytest.approx(2.0) and rows[0].ttft_p99_ratio == pytest.approx(0.5)
    assert (rows[0].texts_agree, rows[0].texts_compared) == (1, 2)
    assert rows[1].output_tokens_per_s_ratio == pytest.approx(2.5) and rows[1].ttft_p99_ratio == pytest.approx(2.0)
    assert (rows[1].texts_agree, rows[1].texts_compared) == (0, 0)  # the failed request is not compared


# ---------------------------------------------------------------- SSE parsing on canned streams


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _parse(body: bytes, status: int = 200, chat: bool = True, max_tokens: int = 3) -> RequestRecord:
    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, Endpoint("http://test", "m", chat, max_tokens), "hi", max_tokens, 10.0)

    return asyncio.run(go())


def _delta(content=None, finish=None, **extra):
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_parse_fastdecode_stream_with_per_chunk_tokens_and_usage():
    body = _sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        _delta("Hel", fastdecode={"tokens": 1}),
        _delta("lo wor", fastdecode={"tokens": 3}),
        _delta("", fastdecode={"tokens": 1}),  # a token whose text the detokenizer still holds back
        _delta(finish="length", fastdecode={"tokens": 0}),
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5}},
        b"[DONE]",
    )
    r = _parse(body, max_tokens=5)
    assert r.error is None and r.text == "Hello wor" and r.finish_reason == "length"
    assert (r.output_tokens, r.tokens_counted_by, r.chunk_tokens) == (5, "usage", [1, 3, 1])
    assert len(r.chunk_times_s) == 3 and r.ttft_s == r.chunk_times_s[0]


def test_parse_stream_without_usage_counts_length_or_leaves_it_to_the_tokenizer():
    by_length = _parse(_sse(_delta("a"), _delta("b"), _delta("c"), _delta(finish="length"), b"[DONE]"), max_tokens=3)
    assert (by_length.output_tokens, by_length.tokens_counted_by, by_length.chunk_tokens) == (3, "length", None)
    stopped = _parse(_sse(_delta("a"), _delta(finish="stop"), b"[DONE]"))
    assert (stopped.output_tokens, stopped.tokens_counted_by) == (None, "tokenizer")
    completion = _parse(
        _sse(
            {"choices": [{"index": 0, "text": "xy", "finish_reason": None}]},
            {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
            b"[DONE]",
        ),
        chat=False,
    )
    assert completion.text == "xy" and completion.error is None


def test_parse_errors_become_the_records_error():
    assert (
        _parse(json.dumps({"error": {"message": "no such model"}}).encode(), status=404).error
        == "HTTP 404: no such model"
    )
    assert _parse(_sse(_delta("a"), {"error": {"message": "engine died"}})).error == "stream error: engine died"
    assert _parse(b"data: {not json\n\n").error.startswith("JSONDecodeError")
    # llama-cpp-python's server, with interrupt_requests on, ends a stream with [DONE] when another request waits
    assert _parse(_sse(_delta("a"), b"[DONE]")).error == "the stream ended without a finish_reason"


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a one-line chat template (the server's chat endpoint needs one)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def test_bench_serve_against_fastdecode_serve(
    chat_model_dir, prompts_file, tmp_path, capsys, monkeypatch, child_process_env
):
    from fastdecode import Engine
    from fastdecode.loading import load_model

    monkeypatch.setenv("PYTHONPATH", child_process_env["PYTHONPATH"])  # the server it starts runs these sources
    monkeypatch.setenv("FASTDECODE_API_KEY", "k3y")  # the server it starts must not take this as its key
    out = tmp_path / "out"
    code = main(
        [
            "bench-serve",
            "--servers",
            "fastdecode",
            "--model",
            str(chat_model_dir),
            "--prompts-file",
            str(prompts_file),
            "--concurrency",
            "1,2",
            "--num-requests",
            "4",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "results.json").read_text())
    assert [(r["server"], r["concurrency"], r["completed"], r["errors"]) for r in data["runs"]] == [
        ("fastdecode", 1, 4, 0),
        ("fastdecode", 2, 4, 0),
    ]
    assert data["servers"]["fastdecode"]["model_card"]["fastdecode"]["max_num_seqs"] == 2  # = the largest C
    # every request, each equal to the same prompt decoded alone in this process (greedy, chat template)
    model, tokenizer = load_model(str(chat_model_dir))
    engine = Engine(model, tokenizer, max_num_seqs=1)
    expected = [engine.generate(p, max_new_tokens=8) for p in PROMPTS]
    requests = data["requests"]
    # each level its own prompts, none the warm-up's (prompt 0): no repeat for the prefix cache to answer
    assert sorted((r["concurrency"], r["prompt_index"]) for r in requests) == [(1, i) for i in range(1, 5)] + [
        (2, i) for i in range(5, 9)
    ]
    for r in requests:
        want = expected[r["prompt_index"]]
        assert r["error"] is None and r["tokens_counted_by"] == "usage"
        assert r["output_tokens"] == want.num_new_tokens == sum(r["chunk_tokens"])
        assert r["text"] == want.text
        assert r["finish_reason"] == ("length" if want.finish_reason == "length" else "stop")
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    for run, level in zip(data["runs"], (expected[1:5], expected[5:9])):
        assert run["output_tokens"] == sum(e.num_new_tokens for e in level) and run["output_tokens_per_s"] > 0
        # fastdecode reports its prefix cache hits (usage.prompt_tokens_details.cached_tokens)
        assert run["prefix_cache_hit_rate"] is not None and run["prompt_tokens"] > 0
        assert run["cached_prompt_tokens"] == sum(
            r["cached_prompt_tokens"] for r in requests if r["concurrency"] == run["concurrency"]
        )
    assert (
        "| server | C |" in (out / "results.md").read_text() and "prefix cache hits" in (out / "results.md").read_text()
    )
    assert (out / "fastdecode.log").exists()
    assert "fastdecode C=2" in captured.out  # a line per run as it finishes


def test_llama_cpp_is_skipped_with_a_note_when_it_cannot_run(chat_model_dir, prompts_file, tmp_path, capsys):
    # the tiny model is a directory, not a GGUF file: llama.cpp's server cannot load it either way
    out = tmp_path / "out"
    code = main(
        [
            "bench-serve",
            "--servers",
            "llama-cpp",
            "--model",
            str(chat_model_dir),
            "--prompts-file",
            str(prompts_file),
            "--num-requests",
            "4",
            "--concurrency",
            "1",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "skipping the llama-cpp server" in captured.err
    data = json.loads((out / "results.json").read_text())
    assert data["runs"] == [] and data["servers"]["llama-cpp"]["skipped"]


def test_time_limit_stops_cleanly_and_reports_what_was_measured(chat_model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "bench-serve",
            "--servers",
            "fastdecode",
            "--model",
            str(chat_model_dir),
            "--prompts-file",
            str(prompts_file),
            "--num-requests",
            "4",
            "--concurrency",
            "1",
            "--time-limit-s",
            "0.5",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "results.json").read_text())
    assert "server was starting" in data["stopped_early"] and data["runs"] == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "0,4"], "--concurrency values must be >= 1"),
        (["--concurrency", "4,4"], "--concurrency lists a value twice"),
        (["--servers", "fastdecode,vllm"], "unknown server 'vllm'; choose from: fastdecode, llama-cpp"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--time-limit-s", "nan"], "--time-limit-s must be a number of seconds > 0"),
        (["--url", "localhost:8000"], "--url must start with http://"),
        (["--serve-args", "--kv-cache-gb 'x"], "--serve-args: No closing quotation"),
        (["--api-key", "k"], "--api-key is for a server given with --url"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, prompts_file, capsys):
    assert main(["bench-serve", "--prompts-file", str(prompts_file), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_concurrency_list_that_is_not_integers_is_a_usage_error(capsys):
    assert main(["bench-serve", "--concurrency", "1,x"]) == 1
    err = capsys.readouterr().err
    assert "expected comma-separated integers" in err and len(err.splitlines()) == 1


def test_an_unreachable_url_is_an_error(prompts_file, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = [
        "bench-serve",
        "--url",
        url,
        "--prompts-file",
        str(prompts_file),
        "--num-requests",
        "4",
        "--concurrency",
        "1",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"cannot reach {url}" in err and len(err.strip().splitlines()) == 1


def test_a_server_that_fails_to_start_shows_its_last_lines(
    prompts_file, tmp_path, capsys, monkeypatch, child_process_env
):
    """A fastdecode server started as a process of its own (an integration test, as every
    whole-system run: tests/conftest.py), with the sources this process runs."""
    monkeypatch.setenv("PYTHONPATH", child_process_env["PYTHONPATH"])
    missing = tmp_path / "no-such-model"
    code = main(
        [
            "bench-serve",
            "--servers",
            "fastdecode",
            "--model",
            str(missing),
            "--prompts-file",
            str(prompts_file),
            "--num-requests",
            "4",
            "--concurrency",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "the fastdecode server exited (status 1) before it was ready; its last lines:" in err
    assert "no-such-model" in err  # the server's own error, from its log


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_bench_serve_against_llama_cpp_server(prompts_file, tmp_path, capsys, monkeypatch, child_process_env):
    monkeypatch.setenv("PYTHONPATH", child_process_env["PYTHONPATH"])
    out = tmp_path / "out"
    code = main(
        [
            "bench-serve",
            "--servers",
            "llama-cpp",
            "--prompts-file",
            str(prompts_file),
            "--concurrency",
            "1,2",
            "--num-requests",
            "4",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "results.json").read_text())
    assert [(r["concurrency"], r["completed"], r["errors"]) for r in data["runs"]] == [(1, 4, 0), (2, 4, 0)]
    for r in data["requests"]:
        assert 0 < r["output_tokens"] <= 8 and r["text"]
        assert r["tokens_counted_by"] in ("usage", "length", "tokenizer")
