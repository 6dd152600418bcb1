"""``fastdecode serve`` as a process: options, the API key from the environment, and SIGTERM
(stop accepting, let the running request finish, exit 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from fastdecode.cli.commands import build_parser
from fastdecode.util.commands import UsageError


def test_serve_options_parse():
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--drafter",
            "ngram",
            "--max-num-seqs",
            "4",
            "--kv-cache-gb",
            "0.5",
            "--max-waiting",
            "16",
            "--api-key",
            "k",
        ]
    )
    assert (
        args.host,
        args.port,
        args.drafter,
        args.max_num_seqs,
        args.kv_cache_gb,
        args.max_waiting,
        args.api_key,
    ) == ("127.0.0.1", 9001, "ngram", 4, 0.5, 16, "k")
    for bad in (["--port", "70000"], ["--max-waiting", "0"], ["--shutdown-timeout", "-1"]):
        with pytest.raises(UsageError):
            build_parser().parse_args(["serve", *bad])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_lets_the_running_request_finish_then_exits_0(embedded_model_name):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "FASTDECODE_API_KEY": "k3y"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastdecode.cli",
            "serve",
            "--model",
            embedded_model_name,
            "--port",
            str(port),
            "--drafter",
            "ngram",
            "--max-num-seqs",
            "2",
            "--kv-cache-gb",
            "0.1",
            "--shutdown-timeout",
            "120",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from FASTDECODE_API_KEY
        headers = {"Authorization": "Bearer k3y"}
        card = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]
        assert card["id"] == "smollm2-135m" and card["fastdecode"]["drafter"] == "ngram"
        assert card["fastdecode"]["weights"] == "gguf:q4_1+q8_0"  # the default: the file's own blocks, named

        events: list[str] = []
        first = threading.Event()

        def read_stream():
            body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        first.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first.wait(120)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        if reader.is_alive():  # still streaming: new connections are refused meanwhile
            with pytest.raises(httpx.TransportError):
                httpx.get(url + "/health", timeout=2)
        reader.join(300)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # it ran to max_tokens, not aborted
    assert sum(c["fastdecode"]["tokens"] for c in chunks) == 48


def test_serve_caps_prefill_chunks_while_streams_decode_and_generate_does_not():
    from fastdecode.cli.commands import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).long_prefill_token_threshold == 64
    assert parser.parse_args(["serve", "--long-prefill-token-threshold", "16"]).long_prefill_token_threshold == 16
    assert parser.parse_args(["generate", "--prompt", "x"]).long_prefill_token_threshold is None


def test_serve_shares_running_slots_by_time_slices_and_generate_does_not():
    from fastdecode.cli.commands import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve"]).time_slice_tokens == 32
    assert parser.parse_args(["serve", "--time-slice-tokens", "8"]).time_slice_tokens == 8
    assert parser.parse_args(["serve", "--time-slice-tokens", "0"]).time_slice_tokens is None  # 0: off
    assert parser.parse_args(["generate", "--prompt", "x"]).time_slice_tokens is None


def test_a_body_cap_beyond_the_memory_left_is_one_error(capsys):
    from fastdecode.cli import main

    assert main(["serve", "--max-request-bytes", str(2**62)]) == 1  # refused before any model loads
    err = capsys.readouterr().err
    assert "--max-request-bytes 4611686018427387904 needs" in err and len(err.splitlines()) == 1
