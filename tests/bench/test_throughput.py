"""``fastdecode throughput`` on a tiny model: the closed loop keeps C requests in flight,
returns results in prompt order equal to decoding each alone, and the command writes
its report."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.bench.throughput import percentile, run_closed_loop

PROMPTS = [[1, 20, 21, 22, 23] * 3, [1, 50, 51, 52], [1] + list(range(10, 40)), [1, 9, 8, 7] * 4, [1, 70, 71]]


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


@pytest.mark.parametrize("concurrency", [1, 2, 5])
def test_closed_loop_keeps_order_and_equals_solo(tiny_model, tokenizer, concurrency):
    solo = Engine(tiny_model, tokenizer, max_num_seqs=1)
    expected = [solo.generate(p, max_new_tokens=12).token_ids for p in PROMPTS]
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", n=3), max_num_seqs=concurrency)
    in_flight = []
    step = engine.step

    def counting_step():
        in_flight.append(engine.num_running + engine.num_waiting)
        return step()

    engine.step = counting_step
    results, wall_s, ttfts, itls = run_closed_loop(engine, PROMPTS, concurrency, None, max_new_tokens=12)
    assert [r.token_ids for r in results] == expected
    assert max(in_flight) == concurrency and len(ttfts) == len(PROMPTS)
    assert len(itls) == sum(len(r.token_ids) - 1 for r in results) and wall_s > 0


def test_throughput_command_writes_its_report(tmp_path, capsys):

    from fastdecode.cli import main

    model_dir = tmp_path / "model"
    save_tiny_llama(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": " ".join(f"w{(i * j) % 9}" for i in range(6 + j))}) for j in range(4))
    )
    out = tmp_path / "out"
    code = main(
        [
            "throughput",
            "--model",
            str(model_dir),
            "--no-chat",
            "--prompts",
            str(prompts),
            "--num-requests",
            "4",
            "--concurrency",
            "1,2",
            "--max-new-tokens",
            "6",
            "--prefix-tokens",
            "40",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "throughput.json").read_text())
    assert [(r["drafter"], r["concurrency"]) for r in data["runs"]] == [
        ("none", 1),
        ("ngram", 1),
        ("none", 2),
        ("ngram", 2),
    ]
    assert all(r["identical_to_solo_plain"] for r in data["runs"])
    prefix = data["prefix"][0]
    # the 40-token prefix's two full blocks at least (this word-level tokenizer also maps both
    # questions' words to the same unknown token, so their first tokens match too)
    assert 32 <= prefix["cached_tokens"] < prefix["prompt_tokens"]
    assert "| weights | drafter | C |" in (out / "throughput.md").read_text()


def test_throughput_runs_block_weights_and_a_float16_kv_cache(tmp_path, capsys):
    from fastdecode.cli import main

    model_dir = tmp_path / "model"
    save_tiny_llama(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": " ".join(f"w{(i * j) % 7}" for i in range(5 + j))}) for j in range(3))
    )
    out = tmp_path / "out"
    code = main(
        [
            "throughput",
            "--model",
            str(model_dir),
            "--no-chat",
            "--prompts",
            str(prompts),
            "--num-requests",
            "3",
            "--weights",
            "q4_0",
            "--kv-cache-dtype",
            "float16",
            "--concurrency",
            "2",
            "--max-new-tokens",
            "6",
            "--prefix-tokens",
            "0",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "throughput.json").read_text())
    assert data["settings"]["kv_cache_dtype"] == "float16" and data["settings"]["weights"] == ["q4_0"]
    assert [r["weights"] for r in data["runs"]] == ["q4_0", "q4_0"]
    assert all(r["identical_to_solo_plain"] for r in data["runs"])
