"""Ctrl-C at every phase: exit 130 with one line, and no half-written output or cache.

Most cases run the CLI in this process and send it a real SIGINT at a chosen point (a
patched function signals this process and waits; Python raises KeyboardInterrupt there,
as it does for a terminal's Ctrl-C). One case interrupts a separate ``fastdecode``
process from outside while it streams.
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastdecode.backends.native import NativeTarget
from fastdecode.cli import main

PROMPT = "w1 w2 w3 w1 w2 w3 w4"


@pytest.fixture(autouse=True)
def _default_sigint_handler():
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")


def _save_tiny(path: Path, context: int = 128) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(61)]])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        path
    )
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"))


def sigint_now() -> None:
    """Ctrl-C: SIGINT to this process, then wait for the KeyboardInterrupt it raises here."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(20)
    raise AssertionError("SIGINT did not interrupt")


def interrupt_on_call(monkeypatch, owner, name: str, nth: int = 1) -> list[int]:
    """Replace ``owner.name`` by a wrapper that sends Ctrl-C on its ``nth`` call."""
    original = getattr(owner, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            sigint_now()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = main(argv)
    finally:
        sys.stdout, sys.stderr = saved
    return code, out.getvalue(), err.getvalue()


def assert_interrupted(code: int, err: str) -> None:
    assert code == 130, err
    lines = [line for line in err.splitlines() if not line.startswith("fastdecode: note: ")]
    assert lines == ["fastdecode: interrupted"], err


def litter(directory: Path) -> list[str]:
    """Temporary files or directories left in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def _generate(model_dir, *args):
    return ["generate", "--model", str(model_dir), "--prompt", PROMPT, "--no-chat", *args]


# ---------------------------------------------------------------- generate


def test_ctrl_c_while_loading_the_model(monkeypatch, model_dir):
    import fastdecode.loading

    calls = interrupt_on_call(monkeypatch, fastdecode.loading, "_load_hf")
    code, out, err = run_cli(_generate(model_dir))
    assert calls == [1]
    assert_interrupted(code, err)
    assert out == ""


@pytest.mark.parametrize(
    "phase, nth, args",
    [
        ("prefill", 1, ()),
        ("decode", 6, ()),
        ("decode-speculative", 4, ("--drafter", "ngram")),
    ],
)
def test_ctrl_c_while_generating(monkeypatch, model_dir, phase, nth, args):
    calls = interrupt_on_call(monkeypatch, NativeTarget, "forward_batch", nth)
    code, out, err = run_cli(_generate(model_dir, "--stream", "--max-new-tokens", "60", "--backend", "native", *args))
    assert calls == [nth]
    assert_interrupted(code, err)
    assert (out == "") == (phase == "prefill")  # decoding had streamed some text


def test_ctrl_c_in_a_batch_leaves_only_whole_json_lines(monkeypatch, model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}", "max_new_tokens": 2 + 4 * i}) + "\n" for i in range(6))
    )
    calls = interrupt_on_call(monkeypatch, NativeTarget, "forward_batch", 12)
    code, out, err = run_cli(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompts-file",
            str(prompts),
            "--no-chat",
            "--max-num-seqs",
            "2",
            "--backend",
            "native",
        ]
    )
    assert calls == [12]
    assert_interrupted(code, err)
    records = [json.loads(line) for line in out.splitlines()]  # each printed line is a whole record
    assert 0 < len(records) < 6
    assert [r["index"] for r in records] == list(range(len(records)))


# ---------------------------------------------------------------- bench, quantize, distill: outputs


def _bench(model_dir, out, prompts):
    return [
        "bench",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--no-chat",
        "--peers",
        "none",
        "--no-progress",
        "--no-plots",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        "--backend",
        "native",
    ]


@pytest.fixture
def bench_prompts(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2} w{i}", "category": "c"}) + "\n" for i in range(3))
    )
    return path


def test_ctrl_c_during_a_benchmark_leaves_no_output_directory(monkeypatch, model_dir, tmp_path, bench_prompts):
    out = tmp_path / "results" / "run1"
    calls = interrupt_on_call(monkeypatch, NativeTarget, "forward_batch", 20)
    code, stdout, err = run_cli(_bench(model_dir, out, bench_prompts))
    assert calls == [20]
    assert_interrupted(code, err)
    assert not (tmp_path / "results").exists()


def test_ctrl_c_while_writing_benchmark_results_keeps_the_old_ones(monkeypatch, model_dir, tmp_path, bench_prompts):
    import fastdecode.bench.report

    out = tmp_path / "results"
    out.mkdir()
    (out / "results.jsonl").write_text("old\n")
    calls = interrupt_on_call(monkeypatch, fastdecode.bench.report, "render_markdown")  # after results.jsonl is staged
    code, _, err = run_cli(_bench(model_dir, out, bench_prompts))
    assert calls == [1]
    assert_interrupted(code, err)
    assert [p.name for p in out.iterdir()] == ["results.jsonl"]
    assert (out / "results.jsonl").read_text() == "old\n"
    assert litter(tmp_path) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new-dir", "empty-dir"])
def test_ctrl_c_while_saving_a_quantized_model(monkeypatch, model_dir, tmp_path, existing):
    import safetensors.torch

    out = tmp_path / "quantized"
    if existing:
        out.mkdir()
    calls = interrupt_on_call(monkeypatch, safetensors.torch, "save_model")  # after config and tokenizer are written
    code, stdout, err = run_cli(["quantize", str(model_dir), "--method", "int8", "--out", str(out)])
    assert calls == [1]
    assert_interrupted(code, err)
    assert (list(out.iterdir()) == []) if existing else not out.exists()
    assert litter(tmp_path) == []


@pytest.mark.parametrize("where, nth", [("train", 1), ("measure_acceptance", 2)], ids=["training", "after-saving"])
def test_ctrl_c_while_distilling(monkeypatch, model_dir, tmp_path, where, nth):
    import fastdecode.distill.command

    out = tmp_path / "drafter"
    calls = interrupt_on_call(monkeypatch, fastdecode.distill.command, where, nth)
    code, _, err = run_cli(
        [
            "distill-drafter",
            "--model",
            str(model_dir),
            "--out",
            str(out),
            "--layers",
            "2",
            "--steps",
            "1",
            "--num-prompts",
            "1",
            "--new-tokens",
            "4",
            "--eval-new-tokens",
            "4",
            "--no-progress",
        ]
    )
    assert calls == [nth]
    assert_interrupted(code, err)
    assert not out.exists()
    assert litter(tmp_path) == []


def test_ctrl_c_while_caching_a_gguf_tokenizer_leaves_no_partial_copy(monkeypatch, tmp_path, model_dir):
    # a GGUF's weights are no longer converted and cached; its tokenizer is (loaders/gguf_tokenizer.py)
    from transformers import AutoTokenizer

    from fastdecode.loaders.gguf_tokenizer import _save

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cached = tmp_path / "cache" / "tokenizers" / "0123"
    interrupt_on_call(monkeypatch, type(tokenizer), "save_pretrained")
    with pytest.raises(KeyboardInterrupt):
        _save(tokenizer, cached)
    assert list(cached.parent.iterdir()) == []


# ---------------------------------------------------------------- a real process, interrupted from outside


def test_ctrl_c_sent_to_a_streaming_process(tmp_path, child_process_env):
    model_dir = _save_tiny(tmp_path / "long", context=4096)
    env = dict(child_process_env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastdecode.cli",
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            PROMPT,
            "--no-chat",
            "--stream",
            "--max-new-tokens",
            "4000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        # Wait for decoding to start (the first streamed text), then press Ctrl-C.
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        assert ready, "no output within 180 s"
        first = os.read(proc.stdout.fileno(), 4096)
        assert first, proc.stderr.read().decode()
        assert proc.poll() is None, "finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_interrupted(proc.returncode, err.decode())
