"""``fastdecode bench --quality``: a quality table per target beside the speed tables."""

import json

from fastdecode.bench.cli import main
from fastdecode.bench.report import REPORT_FILE, SUMMARY_FILE


def test_quality_column_per_weights_config(tiny_model_dir, tmp_path, capsys, short_evaluation_text):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "ab ab ab ab ab", "category": "rep"}) + "\n")
    out = tmp_path / "out"
    argv = ["--model", tiny_model_dir, "--prompts", prompts, "--drafters", "none", "--weights", "float,q4_0"]
    argv += ["--peers", "none", "--quick", "--no-progress", "--no-plots", "--quality", "--quality-windows", "1"]
    assert main(["bench", *map(str, argv), "--out", str(out)]) == 0
    assert "\nQuality\n" in capsys.readouterr().out
    report = (out / REPORT_FILE).read_text()
    assert "## Quality" in report and "| target | perplexity | top-1 agreement | KL (nats/token) |" in report
    quality = {q["weights"]: q for q in json.loads((out / SUMMARY_FILE).read_text())["quality"]}
    assert set(quality) == {"float", "q4_0"}
    assert quality["float"]["kl"] == 0.0 and quality["float"]["top1_agreement"] == 1.0
    assert quality["q4_0"]["kl"] > 0 and quality["q4_0"]["num_windows"] == 1
    assert quality["q4_0"]["window_tokens"] == 2048
