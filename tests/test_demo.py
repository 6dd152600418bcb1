"""``fastdecode demo`` on a tiny local model directory: the target options reach make_target."""

import re

import pytest
from tiny_models import save_tiny_llama

import fastdecode.demo as demo
from fastdecode.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The suite's prompts are mostly <unk> here: a short sequence, which is all the demo needs.
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-demo"), max_position_embeddings=512)


@pytest.fixture
def make_target_calls(monkeypatch):
    calls = []
    real = demo.make_target

    def spy(*args, **kwargs):
        calls.append((args[1:], kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "make_target", spy)
    return calls


def test_run_demo_builds_its_target_with_the_float_kernel(model_dir, make_target_calls, capsys):
    code = demo.run_demo(str(model_dir), max_new_tokens=4, backend="native", float_kernel="torch")
    out = capsys.readouterr().out
    assert code == 0, out
    assert make_target_calls == [(("native", "float", "torch", "auto"), {})]
    assert "backend native, weights float, dtype float32, torch kernels" in out
    assert re.search(r"┃ +self ┃", out)  # float32 on the CPU: the model's own blocks (Q8_0 here, not a GGUF) draft too


def test_demo_command_passes_float_kernel(model_dir, make_target_calls, capsys):
    code = main(
        [
            "demo",
            "--model",
            str(model_dir),
            "--max-new-tokens",
            "4",
            "--backend",
            "native",
            "--float-kernel",
            "torch",
            "--kv-cache-dtype",
            "float16",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert make_target_calls == [(("native", "float", "torch", "float16"), {})]
    assert "torch kernels" in out
