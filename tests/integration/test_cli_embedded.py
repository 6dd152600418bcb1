"""The fastdecode command: JSON schema, streaming, and one clear error per bad input."""

import json
import os
import subprocess
import sys

import pytest

SCHEMA = {
    "text",
    "token_ids",
    "num_prompt_tokens",
    "num_new_tokens",
    "ttft_s",
    "decode_tokens_per_s",
    "wall_s",
    "drafter",
    "acceptance",
    "finish_reason",
}


def run_cli(*args, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def assert_clean_error(proc, pattern):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("fastdecode: error:"), proc.stderr
    assert pattern in lines[-1]


def test_generate_json_schema_plain():
    proc = run_cli("generate", "--json", "--max-new-tokens", "32", "--prompt", "Name three colors.")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= SCHEMA
    assert out["drafter"] == "none" and out["acceptance"] is None
    assert 0 < out["num_new_tokens"] == len(out["token_ids"]) <= 32
    assert out["text"]


def test_generate_json_with_ngram_reports_acceptance():
    proc = run_cli(
        "generate",
        "--json",
        "--max-new-tokens",
        "32",
        "--drafter",
        "ngram",
        "--prompt",
        "Repeat this line twice: the quick brown fox jumps over the lazy dog",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["drafter"] == "ngram"
    acc = out["acceptance"]
    assert {
        "steps",
        "drafted_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_tokens_per_step",
        "per_position_acceptance",
        "alpha_k_bound",
    } <= set(acc)
    assert acc["draft_k"] == 7


def test_stream_prints_the_same_text_as_blocking(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Name three colors.")
    blocking = run_cli("generate", "--prompt-file", str(prompt), "--max-new-tokens", "24")
    streamed = run_cli("generate", "--stream", "--max-new-tokens", "24", stdin="Name three colors.")
    assert blocking.returncode == streamed.returncode == 0
    assert blocking.stdout == streamed.stdout


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--model", "/nonexistent/model.gguf"], "no such file"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-5"], "top_k"),
        (["--draft-k", "0", "--drafter", "ngram"], "k must be"),
        (["--ngram-n", "1", "--drafter", "ngram"], "N must be"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bad_input_gets_one_clear_error(args, pattern):
    assert_clean_error(run_cli("generate", "--prompt", "hi", *args), pattern)


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    assert_clean_error(run_cli("generate", "--prompt", "hi", "--model", str(bad)), "corrupt or truncated")


def test_over_long_prompt(tmp_path):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("word " * 9000)
    assert_clean_error(run_cli("generate", "--prompt-file", str(long_prompt)), "context length")


def test_empty_prompt():
    assert_clean_error(run_cli("generate"), "prompt is empty")
