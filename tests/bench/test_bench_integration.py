"""``fastdecode bench --quick`` on the embedded model: one sample per suite category, plain vs ngram vs HF generate."""

import json

from fastdecode.bench.cli import main
from fastdecode.bench.report import REPORT_FILE, RESULTS_FILE


def test_quick_bench_on_smollm2(tmp_path, embedded_model_name):
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--model",
            embedded_model_name,
            "--quick",
            "--limit",
            "1",
            "--max-new-tokens",
            "12",
            "--drafters",
            "none,ngram",
            "--peers",
            "hf",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]
    assert [r["config"] for r in rows[::5]] == ["none", "ngram N=5 K=7", "hf generate"]
    assert [r["category"] for r in rows[:5]] == ["summarize", "qa", "code", "translate", "chat"]
    assert all(r["identical_to_baseline"] is True for r in rows)
    assert all(r["text"] and r["num_prompt_tokens"] > 20 for r in rows)  # the chat template was applied
    report = (out / REPORT_FILE).read_text()
    assert "| ngram N=5 K=7 | 5 | " in report and "5/5" in report
    assert (out / "speedup_by_category.png").is_file() and (out / "tokens_per_s_vs_alpha.png").is_file()
