"""``fastdecode bench --quick`` end to end on a tiny random-weight Llama saved as a local model directory."""

import argparse
import json

import pytest

from fastdecode.bench.cli import add_bench_parser, main
from fastdecode.bench.report import REPORT_FILE, RESULTS_FILE, SUMMARY_FILE


def run(*argv):
    return main(["bench", *map(str, argv)])


def read_rows(out):
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def quick_run(tiny_model_dir, tmp_path_factory):
    """One quick run: suite + a user JSONL + a local CNN/DailyMail file, two drafters, the HF peers."""
    tmp = tmp_path_factory.mktemp("quick")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc", "category": "mine"}) + "\n")
    cnn = tmp / "cnn.jsonl"
    cnn.write_text(
        "".join(
            json.dumps({"article": f"The cat sat on the mat {i} times.", "highlights": "Cat."}) + "\n" for i in range(3)
        )
    )
    out = tmp / "out"
    rc = run(
        "--model",
        tiny_model_dir,
        "--quick",
        "--datasets",
        "suite",
        "--prompts",
        prompts,
        "--dataset-file",
        cnn,
        "--drafters",
        "ngram,prompt-lookup",
        "--peers",
        "hf,hf-prompt-lookup,hf-assisted,llama-cpp",
        "--out",
        out,
    )
    return rc, out


def test_quick_run_writes_rows_for_every_config_and_sample(quick_run):
    rc, out = quick_run
    assert rc == 0
    rows = read_rows(out)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    assert configs == ["none", "ngram N=5 K=7", "prompt-lookup K=7", "hf generate", "hf prompt-lookup K=7"]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    assert categories == ["summarize", "qa", "code", "translate", "chat", "mine", "summarize-cnn_dailymail"]
    per_config = {c: [r for r in rows if r["config"] == c] for c in configs}
    assert all(len(v) == 5 * 2 + 1 + 2 for v in per_config.values())  # --quick: 2 per category
    for r in rows:
        assert 1 <= r["num_new_tokens"] <= 16 and len(r["token_ids"]) == r["num_new_tokens"]
        assert r["wall_s"] > 0 and r["decode_tokens_per_s"] >= 0 and r["repeats"] == 1
        assert r["identical_to_baseline"] is True  # greedy: every method reproduces plain decoding
        if r["peer"] is None:  # every token after the first came from a decode step's pass
            steps = r["acceptance"]["steps"] if r["acceptance"] else r["num_new_tokens"] - 1
            assert r["decode_passes"] == steps and (r["decode_pass_s"] > 0) == (steps > 0) and r["draft_s"] >= 0
    ngram = per_config["ngram N=5 K=7"][0]["acceptance"]
    assert {"acceptance_rate", "mean_tokens_per_step", "alpha_k_bound", "steps", "step_tokens"} <= set(ngram)
    assert per_config["none"][0]["acceptance"] is None and per_config["none"][0]["is_baseline"]
    assert per_config["hf generate"][0]["peer"] == "hf"
    assert {r["target"] for r in rows if r["peer"] is None} == {"native"}  # backend auto: a Llama runs natively
    assert {r["target"] for r in rows if r["peer"]} == {"transformers generate"}
    # sample i has seed SEED + i in every configuration
    assert [r["seed"] for r in per_config["none"]] == list(range(13))


def test_quick_run_report_tables_plots_and_notes(quick_run):
    _, out = quick_run
    report = (out / REPORT_FILE).read_text()
    for heading in (
        "## Machine",
        "## Configurations",
        "## Speed-up per category",
        "## Plots",
        "## Notes",
        "## Definitions",
    ):
        assert heading in report
    assert (
        "| config | samples | new tokens | mean tok/s | median tok/s | speed-up | alpha | tau | nodes/step | alpha*K+1 | identical |"
        in report
    )
    assert "| config | summarize | qa | code | translate | chat | mine | summarize-cnn_dailymail | overall |" in report
    assert "## Acceptance per category (tau / draft tokens verified a step)" in report
    cost = report.split("## Cost of a decode step per category")[1].split("\n## ")[0]
    assert "| none | " in cost and "(1.00x)" in cost and "| ngram N=5 K=7 | " in cost
    assert "hf generate" not in cost  # a peer records no passes
    assert (
        "## Acceptance by source" in report and "| config | source | drafted | reached | accepted / reached |" in report
    )
    assert "| ngram N=5 K=7 | 2-gram |" in report  # (the n-gram drafter names its sources; prompt lookup does not)
    assert "| none | 13 |" in report and "13/13" in report
    assert "torch" in report and "CPU:" in report
    assert "hf assisted K=7 skipped: no draft model configured" in report
    assert "llama.cpp" in report and "skipped" in report
    for png in ("speedup_by_category.png", "tokens_per_s_vs_alpha.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in report
    summary = json.loads((out / SUMMARY_FILE).read_text())
    base = next(c for c in summary["configs"] if c["config"] == "none")
    assert base["speedup"] == pytest.approx(1.0) and base["identical"] == base["compared"] == 13


def test_sweep_heatmap(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab ab ab ab ab", "category": "rep"}) + "\n")
    out = tmp_path / "out"
    assert (
        run(
            "--model",
            tiny_model_dir,
            "--prompts",
            prompts,
            "--drafters",
            "none",
            "--sweep",
            "ngram-nk",
            "--max-new-tokens",
            6,
            "--warmup",
            0,
            "--peers",
            "none",
            "--backend",
            "hf",
            "--no-progress",
            "--out",
            out,
        )
        == 0
    )
    rows = read_rows(out)
    assert len(rows) == 51 and all(r["identical_to_baseline"] for r in rows)
    assert {r["target"] for r in rows} == {"hf"}
    report = (out / REPORT_FILE).read_text()
    assert "## Sweep `ngram-nk`: speed-up" in report
    assert "| N \\ K | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 |" in report
    assert (out / "ngram_nk_heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_prompts_line_is_one_clear_error(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok", "category": "a"}\n{"prompt": oops}\n')
    assert run("--model", "no-such-model-needed", "--prompts", prompts, "--out", tmp_path / "out") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fastdecode: error:") and "line 2" in err[-1] and "Traceback" not in "\n".join(err)


def test_bad_options_are_config_errors(tmp_path, capsys):
    assert run("--drafters", "none,magic", "--out", tmp_path) == 1
    assert "unknown drafter 'magic'" in capsys.readouterr().err
    assert run("--repeats", 0, "--out", tmp_path) == 1
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_add_bench_parser_wires_into_any_cli():
    parser = argparse.ArgumentParser(prog="fastdecode")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--model", "a", "--model", "b", "--draft-k", "3,7", "--quick", "--out", "o"])
    assert args.model == ["a", "b"] and args.draft_k == [3, 7] and args.quick and args.func.__name__ == "cmd_bench"
    assert args.max_new_tokens is None and args.temperature == 0.0 and args.warmup is None


def test_quantized_drafter_sweep_runs_every_drafter_losslessly(tiny_model_dir, tmp_path):
    """Zhang & Li's table: small drafter (here the target's own directory), target int8/int4/GPTQ/AWQ/SmoothQuant,
    layer-skip, ngram."""
    out = tmp_path / "out"
    rc = run(
        "--model",
        tiny_model_dir,
        "--quick",
        "--limit",
        "1",
        "--datasets",
        "suite",
        "--drafters",
        "none",
        "--sweep",
        "quantized-drafters",
        "--draft-model",
        tiny_model_dir,
        "--peers",
        "none",
        "--no-plots",
        "--out",
        out,
    )
    assert rc == 0
    rows = [r for r in read_rows(out) if r.get("sweep") == "quantized-drafters"]
    labels = {r["sweep_point"]["drafter"] for r in rows}
    assert labels == {
        "small",
        "small int8",
        "small int4",
        "target int8",
        "target int4",
        "target int4-gptq",
        "target awq",
        "target smoothquant",
        "target sparse24",
        "layer-skip",
        "ngram",
    }
    assert all(r["identical_to_baseline"] for r in rows)
