"""`fastdecode bench-scale` (fastdecode.bench.scale, scale_report, scale_job)."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

import fastdecode
from fastdecode.bench.scale import (
    FASTDECODE,
    LLAMA_CPP,
    ScaleRow,
    ScaleSettings,
    _jsonl,
    _load_ms,
    combine_rounds,
    llama_cpp_tools,
    paired_ratios,
    run_child,
    settings_from_args,
)
from fastdecode.bench.scale_report import render_markdown, table_rows
from fastdecode.errors import ConfigError


def test_a_childs_peak_resident_memory_is_its_own():
    grow = "import sys; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    run = run_child([sys.executable, "-c", grow], timeout_s=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok"
    assert 300 * 2**20 < run.peak_rss_bytes < 600 * 2**20
    small = run_child([sys.executable, "-c", "pass"], timeout_s=120)
    assert small.peak_rss_bytes < 200 * 2**20  # not the earlier child's peak


def test_a_child_past_its_time_is_killed():
    run = run_child([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5)
    assert run.returncode != 0 and run.wall_s < 30


def test_llama_cpp_output_is_read():
    class Run:
        stdout = '{"pp": 16, "tg": 64, "pl": 8, "speed_tg": 41.5}\nnot json {\n'
        stderr = "llama_perf_context_print:        load time =     812.34 ms\n"

    assert _load_ms(Run) == pytest.approx(0.81234)
    assert _jsonl(Run.stdout) == [{"pp": 16, "tg": 64, "pl": 8, "speed_tg": 41.5}]


def test_missing_llama_cpp_is_a_note_not_a_failure(tmp_path):
    tools, note = llama_cpp_tools(str(tmp_path))
    assert tools is None and "no llama-bench, llama-batched-bench" in note and "setup_peer.sh" in note
    assert llama_cpp_tools(None)[0] is None


def _args(**overrides):
    base = dict(
        shapes="tiny-llama",
        types="q8_0",
        cache_dir="c",
        prompt_tokens=512,
        decode_tokens=64,
        batch=8,
        repeats=1,
        rounds=1,
        threads=None,
        weights=None,
        llama_cpp_bin="none",
        timeout_s=60.0,
    )
    return argparse.Namespace(**{**base, **overrides})


def test_settings_refuse_unknown_names_and_empty_counts():
    assert settings_from_args(_args()).llama_cpp_bin is None
    with pytest.raises(ConfigError, match="unknown shape llama-70b"):
        settings_from_args(_args(shapes="tiny-llama,llama-70b"))
    with pytest.raises(ConfigError, match="unknown type q4_k_l"):
        settings_from_args(_args(types="q4_k_l"))
    with pytest.raises(ConfigError, match="--batch must be >= 1"):
        settings_from_args(_args(batch=0))
    with pytest.raises(ConfigError, match="--rounds must be >= 1"):
        settings_from_args(_args(rounds=0))


def _round(engine, decode, load, peak, note=""):
    return ScaleRow("s", "t", 2**30, engine, load_s=load, peak_rss_bytes=peak, decode_tokens_per_s_1=decode, note=note)


def test_rounds_combine_into_medians_and_paired_ratios():
    ours = [_round(FASTDECODE, d, 1.0 + i, 10 + i, "native") for i, d in enumerate((30.0, 20.0, 24.0))]
    theirs = [_round(LLAMA_CPP, d, 0.5, 9) for d in (25.0, 16.0, 20.0)]
    theirs[2].decode_tokens_per_s_1 = None  # a round that measured nothing is left out of the median
    row = combine_rounds(ours)
    assert (row.decode_tokens_per_s_1, row.load_s, row.peak_rss_bytes) == (24.0, 2.0, 12)  # medians; peak the largest
    assert row.prefill_tokens_per_s is None and row.note == "native; median of 3 rounds"
    assert combine_rounds(theirs).decode_tokens_per_s_1 == pytest.approx(20.5)
    ratios = paired_ratios({FASTDECODE: ours, LLAMA_CPP: theirs})
    assert ratios["decode_tokens_per_s_1"]["rounds"] == [pytest.approx(1.2), pytest.approx(1.25), None]
    assert ratios["decode_tokens_per_s_1"]["median"] == pytest.approx(1.225)
    assert ratios["load_s"]["rounds"] == [pytest.approx(0.5), pytest.approx(0.25), pytest.approx(0.5 / 3)]
    assert ratios["prefill_tokens_per_s"] == {"rounds": [None, None, None], "median": None}
    assert combine_rounds([ours[0]]).note == "native"  # one round: no count
    assert ours[0].decode_tokens_per_s_1 == 30.0  # the rounds' rows are left as they were
    described = {
        "cpu": "CPU",
        "usable_cores": 2,
        "logical_cores": 2,
        "cpu_flags": [],
        "load_average": None,
        "date": "d",
    }
    per_file = {"s t": {"rounds": {FASTDECODE: [], LLAMA_CPP: []}, "ratios": ratios}}
    text = render_markdown([row], ScaleSettings(["s"], ["t"], "c", rounds=3), described, "", per_file)
    assert "3 round(s)" in text and "| s t | - | **1.23x** (1.20, 1.25, -) |" in text


def test_the_table_puts_each_engine_on_its_own_row():
    rows = [
        ScaleRow(
            "llama-3.2-1b",
            "q4_k_m",
            2**30,
            FASTDECODE,
            load_first_s=3.0,
            load_s=1.5,
            peak_rss_load_bytes=2**29,
            peak_rss_bytes=3 * 2**29,
            prefill_tokens_per_s=100.0,
            decode_tokens_per_s_1=10.0,
            decode_tokens_per_s_batch=40.0,
        ),
        ScaleRow("llama-3.2-1b", "q4_k_m", 2**30, LLAMA_CPP, note="llama-bench exit 1: boom"),
    ]
    table = table_rows(rows)
    assert table[0] == ["llama-3.2-1b", "q4_k_m", "1.00", FASTDECODE, "3.00", "1.50", "1.50", "1.50", "0.50"] + [
        "100.0",
        "10.0",
        "40.0",
    ]
    assert table[1][3:] == [LLAMA_CPP, "-", "-", "-", "-", "-", "-", "-", "-"]
    described = {"cpu": "CPU", "usable_cores": 2, "logical_cores": 2, "cpu_flags": ["avx2"], "load_average": None}
    text = render_markdown(rows, ScaleSettings(["llama-3.2-1b"], ["q4_k_m"], "c"), described | {"date": "d"}, "")
    assert "| llama-3.2-1b | q4_k_m |" in text and "llama-bench exit 1: boom" in text and "avx2" in text


@pytest.mark.integration
def test_bench_scale_runs_end_to_end_on_a_tiny_shape(tmp_path):
    """Only that it runs: tiny counts on a 4-layer shape, llama.cpp too where scripts/setup_peer.sh built it."""
    from fastdecode.bench.scale import run_child as run

    repo = Path(fastdecode.__file__).parents[2]
    bin_dir = repo / ".peer/llama.cpp/build/bin"
    env = dict(os.environ, PYTHONPATH=str(repo / "src"), FASTDECODE_NO_CACHE="1")
    cmd = [sys.executable, "-m", "fastdecode.cli", "bench-scale", "--shapes", "tiny-llama", "--types", "q8_0"]
    cmd += ["--cache-dir", str(tmp_path / "files"), "--out", str(tmp_path / "out"), "--prompt-tokens", "32"]
    cmd += ["--decode-tokens", "4", "--batch", "2", "--threads", "1", "--no-plot"]
    cmd += ["--llama-cpp-bin", str(bin_dir) if (bin_dir / "llama-bench").exists() else "none"]
    result = run(cmd, timeout_s=1800, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    ours = next(r for r in rows if r["engine"] == FASTDECODE)
    assert ours["prefill_tokens_per_s"] > 0 and ours["decode_tokens_per_s_batch"] > 0, ours
    assert ours["peak_rss_bytes"] > 0 and ours["load_first_s"] > 0
    assert "| tiny-llama | q8_0 |" in (tmp_path / "out" / "results.md").read_text()
