"""``fastdecode demo`` on a tiny local model directory: the target options reach make_target."""

import re

import pytest
from tiny_models import save_tiny_llama

import fastdecode.cli.demo as demo
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
        calls.append((args[1:], {k: v for k, v in kwargs.items() if k != "tokenizer"}))  # the tokenizer: calibration
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "make_target", spy)
    return calls


def test_run_demo_builds_its_target_with_the_float_kernel(model_dir, make_target_calls, capsys):
    code = demo.run_demo(str(model_dir), max_new_tokens=4, backend="native", float_kernel="torch")
    out = capsys.readouterr().out
    assert code == 0, out
    assert make_target_calls == [(("native", "float", "torch", "auto"), {})]
    assert "backend native, weights float, dtype float32, torch kernels" in out
    assert re.search(
        r" self +x +tau +same", out
    )  # float32 on the CPU: the model's own blocks (Q8_0 here, not a GGUF) draft too


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


def test_the_demo_table_fits_80_columns_at_its_widest():
    from rich.console import Console

    table = demo.results_table(with_self=True)
    table.add_row("summarize", "128", "9999.9", "9999.9", "99.99x", "99.99", "9999.9", "99.99x", "99.99", "yes")
    wide = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 (what it would print, unwrapped)
    wide.print(table)
    lines = wide.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)


def test_the_demo_states_the_machine_load_first(model_dir, capsys):
    code = demo.run_demo(str(model_dir), max_new_tokens=2, backend="native", float_kernel="torch")
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    load_line = next(i for i, line in enumerate(lines) if line.startswith("machine: "))
    assert "CPUs usable" in lines[load_line] and "thread" in lines[load_line]
    assert load_line < next(i for i, line in enumerate(lines) if line.startswith("backend "))


def test_the_busy_warning_follows_the_free_cores_not_the_load_average(monkeypatch):
    from fastdecode.bench import load
    from fastdecode.kernels import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(load, "load_average", lambda: (3.5, 1.0, 0.5))  # a run that just ended
    monkeypatch.setattr(threads, "free_cores", lambda: 1.9)
    line = demo.machine_load_line(2)
    assert "1.9 free" in line and "load 3.50" in line and "busy" not in line
    monkeypatch.setattr(threads, "free_cores", lambda: 1.0)  # one core taken by another process
    assert "busy" in demo.machine_load_line(2) and "busy" not in demo.machine_load_line(1)
    monkeypatch.setattr(threads, "free_cores", lambda: 0.2)  # every core taken
    assert "busy" in demo.machine_load_line(1)
