"""``fastdecode generate``'s decoding flags on a tiny model directory: penalties, bias,
min_tokens and logprobs give plain decoding's tokens under a drafter; bad values are one
clear error."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_llama

from fastdecode.cli import main
from fastdecode.cli.decoding import parse_logit_bias
from fastdecode.errors import ConfigError

PROMPT = " ".join(f"w{i % 7}" for i in range(30))
FLAGS = ["--frequency-penalty", "0.8", "--presence-penalty", "0.3", "--repetition-penalty", "1.2"]
FLAGS += ["--logit-bias", "5:2.5,9:-100", "--min-tokens", "20", "--logprobs", "2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4)


def generate(capsys, model_dir, *args):
    base = ["generate", "--model", str(model_dir), "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "24"]
    code = main([*base, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("drafter", [["--drafter", "ngram"], ["--drafter", "draft-model", "--draft-k", "3"]])
def test_decoding_flags_are_lossless_under_a_drafter(capsys, model_dir, drafter):
    code, out, err = generate(capsys, model_dir, "--json", *FLAGS)
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = generate(capsys, model_dir, "--json", *FLAGS, *drafter)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["acceptance"]["drafted_tokens"] > 0
    assert 9 not in plain["token_ids"] and 2 not in plain["token_ids"][:20]
    assert [e["token_id"] for e in plain["logprobs"]] == plain["token_ids"]
    assert all(len(e["top"]) == 2 for e in plain["logprobs"])
    _, out, _ = generate(capsys, model_dir, "--json")
    assert json.loads(out)["token_ids"] != plain["token_ids"]


def test_logprobs_are_printed_without_json(capsys, model_dir):
    code, out, err = generate(capsys, model_dir, "--logprobs", "1", "--max-new-tokens", "3")
    assert code == 0 and len([line for line in err.splitlines() if "[" in line and "]" in line]) >= 3


def test_logit_bias_forms():
    assert parse_logit_bias('{"5": -100, "7": 2}') == {"5": -100, "7": 2}
    assert parse_logit_bias("5:-100, 7:2.5") == {5: -100.0, 7: 2.5}
    assert parse_logit_bias(None) == {}
    for bad in ("5", "a:1", "{oops", "[1]"):
        with pytest.raises(ConfigError, match="--logit-bias"):
            parse_logit_bias(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--logit-bias", "999:1"], "outside the vocabulary"),
        (["--logit-bias", "5:1000"], r"logit_bias\[5\]"),
        (["--frequency-penalty", "9"], "frequency_penalty"),
        (["--min-tokens", "-2"], "min_tokens"),
        (["--logprobs", "50"], "logprobs"),
        (["--json-schema", "/nonexistent/schema.json"], "cannot read"),
    ],
)
def test_bad_values_are_one_error_line(capsys, model_dir, args, message):
    code, out, err = generate(capsys, model_dir, *args)
    assert code == 1 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastdecode: error:") and __import__("re").search(message, lines[0])


def test_a_schema_that_does_not_compile(capsys, model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"$ref": "#/missing"}}}')
    code, _, err = generate(capsys, model_dir, "--json-schema", str(schema))
    assert code == 1 and "cannot be compiled" in err
    schema.write_text("[1, 2]")
    code, _, err = generate(capsys, model_dir, "--json-schema", str(schema))
    assert code == 1 and "JSON object" in err
