"""Bad input, one table for the command line and one for the Python API.

Every CLI case asserts the exact exit status and the exact shape of stderr: exit 1 with
one ``fastdecode: error:`` line (argparse's usage errors too); never a traceback, never output on stdout, never a half-made output
directory. Every API case asserts the FastDecodeError subclass and its message.
"""

from __future__ import annotations

import io
import json
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import save_tiny_llama, word_tokenizer
from transformers import ViTConfig

from fastdecode.cli import main
from fastdecode.errors import (
    ConfigError,
    FastDecodeError,
    IncompatibleDrafterError,
    ModelLoadError,
    PromptTooLongError,
)

PROMPT = "w1 w2 w3 w1 w2 w3"


def _save_tiny(path: Path, vocab_size: int = 64, words: str = "w") -> Path:
    return save_tiny_llama(path, word_tokenizer(words, vocab_size - 3), vocab_size=vocab_size, num_hidden_layers=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every file the cases name, by placeholder."""
    root = tmp_path_factory.mktemp("bad-inputs")
    model = _save_tiny(root / "model")
    _save_tiny(root / "other-vocab", vocab_size=80, words="v")

    corrupt_weights = root / "corrupt-weights"
    shutil.copytree(model, corrupt_weights)
    (corrupt_weights / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    # A config naming another architecture than the weights hold: transformers would fill
    # every tensor with random numbers and carry on.
    other_arch = root / "other-arch"
    shutil.copytree(model, other_arch)
    config = json.loads((other_arch / "config.json").read_text())
    (other_arch / "config.json").write_text(json.dumps({**config, "model_type": "bert", "architectures": None}))
    vit = root / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(vit)
    (root / "no-config").mkdir()
    (root / "corrupt.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    (root / "not-gguf.gguf").write_bytes(b"PK\x03\x04 a zip, not a gguf")
    (root / "weights.bin").write_bytes(b"\0" * 64)

    (root / "latin1.txt").write_bytes("w1 \xe9t\xe9".encode("latin-1"))  # byte offset 3
    (root / "empty.txt").write_bytes(b"")
    (root / "bom.txt").write_bytes(b"\xef\xbb\xbfw1 \xff")  # offset 6 counts the BOM's 3 bytes
    (root / "a-file").write_text("mine\n")
    (root / "nonempty").mkdir()
    (root / "nonempty" / "notes.txt").write_text("mine\n")

    def jsonl(name: str, data: bytes) -> None:
        (root / name).write_bytes(data)

    jsonl("prompts-bad-json.jsonl", b'{"prompt": "w1 w2"}\n{"prompt": \n')
    jsonl("prompts-stop-int.jsonl", b'{"prompt": "w1 w2", "stop": 5}\n')
    jsonl("prompts-surrogate.jsonl", b'{"prompt": "w1 \\udcff"}\n')
    jsonl("prompts-max-new-str.jsonl", b'{"prompt": "w1", "max_new_tokens": "5"}\n')
    jsonl("prompts-seed-huge.jsonl", b'{"prompt": "w1", "seed": 18446744073709551616}\n')
    jsonl("bench-bad-json.jsonl", b'{"prompt": "w1 w2", "category": "c"}\n{"prompt": "w1"\n')
    jsonl("bench-latin1.jsonl", b'{"prompt": "\xe9"}\n')
    jsonl("bench-no-prompt.jsonl", b'{"text": "w1 w2"}\n')
    jsonl("bench-empty-prompt.jsonl", b'{"prompt": ""}\n')
    jsonl("bench-good.jsonl", b'{"prompt": "w1 w2 w3", "category": "c"}\n')
    (root / "dataset.txt").write_text("w1 w2\n")

    names = {p.name: str(p) for p in root.iterdir()}
    names.update(
        missing=str(root / "missing"),
        under_file=str(root / "a-file" / "sub"),
        long=" ".join(["w1"] * 200),
        surrogate="w1 \udcff",
    )
    return names


def run_cli(argv: list[str], stdin: bytes | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """``fastdecode ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr, sys.stdin
    sys.stdout, sys.stderr = out, err
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    finally:
        sys.stdout, sys.stderr, sys.stdin = saved
    return code, out.getvalue(), err.getvalue()


def assert_one_error(code: int, out: str, err: str, expected_code: int, pattern: str) -> None:
    """Exit 1: stderr is one ``fastdecode: error:`` line (argparse's usage errors too: issue 42
    item 5, where they were its 37-line usage text and exit 2). Never a traceback; nothing on stdout."""
    assert "Traceback" not in err, err
    assert code == expected_code, err
    assert out == "", out
    lines = [line for line in err.splitlines() if not line.startswith("fastdecode: note: ")]  # notes are not errors
    assert len(lines) == 1 and lines[0].startswith("fastdecode: error: "), err
    assert re.search(pattern, lines[-1]), err


def _gen(*args: str) -> list[str]:
    return ["generate", "--model", "{model}", "--no-chat", "--max-new-tokens", "4", *args]


def _bench(*args: str) -> list[str]:
    return [
        "bench",
        "--model",
        "{model}",
        "--no-chat",
        "--peers",
        "none",
        "--no-progress",
        "--no-plots",
        "--max-new-tokens",
        "2",
        "--out",
        "{new_out}",
        *args,
    ]


def _distill(*args: str) -> list[str]:
    return [
        "distill-drafter",
        "--model",
        "{model}",
        "--layers",
        "2",
        "--steps",
        "1",
        "--num-prompts",
        "1",
        "--new-tokens",
        "2",
        "--eval-new-tokens",
        "2",
        "--no-progress",
        *args,
    ]


P = _gen("--prompt", PROMPT)  # a good prompt, for the flag cases

# (id, argv with {placeholders}, stdin bytes or None, exit status, pattern of the error line)
CLI_CASES = [
    # -- model specs
    (
        "model-missing",
        ["generate", "--model", "{missing}", "--prompt", PROMPT],
        None,
        1,
        r"missing: no such file or directory",
    ),
    (
        "model-unknown-name",
        ["generate", "--model", "nosuchmodel", "--prompt", PROMPT],
        None,
        1,
        r"unknown model 'nosuchmodel'",
    ),
    ("model-empty-spec", ["generate", "--model", "", "--prompt", PROMPT], None, 1, r"empty or unreadable model spec"),
    (
        "model-corrupt-gguf",
        ["generate", "--model", "{corrupt.gguf}", "--prompt", PROMPT],
        None,
        1,
        r"corrupt or truncated GGUF",
    ),
    ("model-not-gguf", ["generate", "--model", "{not-gguf.gguf}", "--prompt", PROMPT], None, 1, r"not a GGUF file"),
    (
        "model-other-file",
        ["generate", "--model", "{weights.bin}", "--prompt", PROMPT],
        None,
        1,
        r"must be a \.gguf file",
    ),
    (
        "model-dir-without-config",
        ["generate", "--model", "{no-config}", "--prompt", PROMPT],
        None,
        1,
        r"no config\.json",
    ),
    (
        "model-corrupt-safetensors",
        ["generate", "--model", "{corrupt-weights}", "--prompt", PROMPT],
        None,
        1,
        r"cannot load the model \(SafetensorError",
    ),
    (
        "model-unsupported-arch",
        ["generate", "--model", "{vit}", "--prompt", PROMPT],
        None,
        1,
        r"unsupported architecture 'vit'",
    ),
    (
        "model-weights-of-another-arch",
        ["generate", "--model", "{other-arch}", "--prompt", PROMPT],
        None,
        1,
        r"weights do not match the 'bert' architecture .* missing",
    ),
    ("model-dtype", P + ["--dtype", "float8"], None, 1, r"unknown dtype 'float8'"),
    ("model-device", P + ["--device", "tpu"], None, 1, r"unknown device 'tpu'"),
    ("model-backend", P + ["--backend", "tpu"], None, 1, r"argument --backend: invalid choice: 'tpu'"),
    # -- prompt sources and encodings
    (
        "prompt-file-latin1",
        _gen("--prompt-file", "{latin1.txt}"),
        None,
        1,
        r"latin1\.txt: not UTF-8 text \(byte offset 3\)",
    ),
    (
        "prompt-file-bom-then-bad",
        _gen("--prompt-file", "{bom.txt}"),
        None,
        1,
        r"bom\.txt: not UTF-8 text \(byte offset 6\)",
    ),
    (
        "prompt-file-missing",
        _gen("--prompt-file", "{missing}"),
        None,
        1,
        r"cannot read prompt file .*missing: No such file",
    ),
    (
        "prompt-file-directory",
        _gen("--prompt-file", "{no-config}"),
        None,
        1,
        r"cannot read prompt file .*: Is a directory",
    ),
    ("prompt-file-empty", _gen("--prompt-file", "{empty.txt}"), None, 1, r"the prompt is empty"),
    ("stdin-not-utf8", _gen(), b"w1 w2 \xff\xfe", 1, r"<stdin>: not UTF-8 text \(byte offset 6\)"),
    ("stdin-empty", _gen(), b"", 1, r"the prompt is empty"),
    ("prompt-arg-not-utf8", _gen("--prompt", "{surrogate}"), None, 1, r"--prompt: not UTF-8 text \(byte offset 3\)"),
    ("prompt-arg-empty", _gen("--prompt", ""), None, 1, r"the prompt is empty"),
    ("prompt-too-long", _gen("--prompt", "{long}"), None, 1, r"the prompt is 200 tokens .* context length is 128"),
    (
        "prompt-and-prompt-file",
        _gen("--prompt", PROMPT, "--prompt-file", "{empty.txt}"),
        None,
        1,
        r"argument --prompt-file: not allowed with argument --prompt",
    ),
    ("stop-not-utf8", P + ["--stop", "{surrogate}"], None, 1, r"--stop: not UTF-8 text \(byte offset 3\)"),
    ("stop-empty", P + ["--stop", ""], None, 1, r"stop strings must be non-empty"),
    (
        "prompts-file-bad-json",
        _gen("--prompts-file", "{prompts-bad-json.jsonl}"),
        None,
        1,
        r"prompts-bad-json\.jsonl:2: not valid JSON",
    ),
    (
        "prompts-file-stop-int",
        _gen("--prompts-file", "{prompts-stop-int.jsonl}"),
        None,
        1,
        r'prompts-stop-int\.jsonl:1: "stop" must be a string or a list of strings',
    ),
    (
        "prompts-file-surrogate",
        _gen("--prompts-file", "{prompts-surrogate.jsonl}"),
        None,
        1,
        r"prompts-surrogate\.jsonl:1: not UTF-8 text",
    ),
    (
        "prompts-file-max-new-str",
        _gen("--prompts-file", "{prompts-max-new-str.jsonl}"),
        None,
        1,
        r"prompts-max-new-str\.jsonl:1: max_new_tokens must be an integer",
    ),
    (
        "prompts-file-seed-huge",
        _gen("--prompts-file", "{prompts-seed-huge.jsonl}"),
        None,
        1,
        r"prompts-seed-huge\.jsonl:1: seed must be an integer in \[0, 2\*\*64\)",
    ),
    (
        "prompts-file-and-stream",
        _gen("--prompts-file", "{bench-good.jsonl}", "--stream"),
        None,
        1,
        r"--stream prints one prompt's text",
    ),
    # -- numeric flags at and beyond their bounds
    ("max-new-tokens-0", P + ["--max-new-tokens", "0"], None, 1, r"max_new_tokens must be an integer >= 1, got 0"),
    (
        "max-new-tokens-negative",
        P + ["--max-new-tokens", "-1"],
        None,
        1,
        r"max_new_tokens must be an integer >= 1, got -1",
    ),
    (
        "max-new-tokens-not-int",
        P + ["--max-new-tokens", "1.5"],
        None,
        1,
        r"argument --max-new-tokens: invalid int value",
    ),
    ("temperature-negative", P + ["--temperature", "-1"], None, 1, r"temperature must be a finite number >= 0"),
    ("temperature-nan", P + ["--temperature", "nan"], None, 1, r"temperature must be a finite number >= 0 .* got nan"),
    ("temperature-inf", P + ["--temperature", "inf"], None, 1, r"temperature must be a finite number >= 0 .* got inf"),
    ("top-p-0", P + ["--top-p", "0"], None, 1, r"top_p must be in \(0, 1\], got 0\.0"),
    ("top-p-1.5", P + ["--top-p", "1.5"], None, 1, r"top_p must be in \(0, 1\], got 1\.5"),
    ("top-p-nan", P + ["--top-p", "nan"], None, 1, r"top_p must be in \(0, 1\], got nan"),
    ("top-k-negative", P + ["--top-k", "-1"], None, 1, r"top_k must be an integer >= 0"),
    ("seed-negative", P + ["--seed", "-1"], None, 1, r"seed must be an integer in \[0, 2\*\*64\)"),
    ("seed-2**64", P + ["--seed", str(2**64)], None, 1, r"seed must be an integer in \[0, 2\*\*64\)"),
    ("draft-k-0", P + ["--drafter", "ngram", "--draft-k", "0"], None, 1, r"k must be an integer >= 1, got 0"),
    ("draft-k-negative-plain", P + ["--draft-k", "-3"], None, 1, r"draft_k must be an integer >= 1, got -3"),
    (
        "ngram-n-1",
        P + ["--drafter", "ngram", "--ngram-n", "1"],
        None,
        1,
        r"n-gram order N must be an integer >= 2, got 1",
    ),
    ("ngram-min-count-negative", P + ["--drafter", "ngram", "--ngram-min-count", "-1"], None, 1, r"min_count must be"),
    (
        "ngram-min-prob-1.5",
        P + ["--drafter", "ngram", "--ngram-min-prob", "1.5"],
        None,
        1,
        r"min_prob must lie in \[0, 1\]",
    ),
    (
        "ngram-min-prob-nan",
        P + ["--drafter", "ngram", "--ngram-min-prob", "nan"],
        None,
        1,
        r"min_prob must lie in \[0, 1\]",
    ),
    ("max-num-seqs-0", P + ["--max-num-seqs", "0"], None, 1, r"argument --max-num-seqs: expected an integer >= 1"),
    ("kv-cache-gb-0", P + ["--kv-cache-gb", "0"], None, 1, r"argument --kv-cache-gb: expected a number > 0"),
    ("kv-cache-gb-inf", P + ["--kv-cache-gb", "inf"], None, 1, r"argument --kv-cache-gb: expected a number > 0"),
    # issue 42, item 5: each was argparse's 37-line usage text and exit 2
    (
        "threads-0",
        P + ["--threads", "0"],
        None,
        1,
        r"argument --threads: expected an integer >= 1, got '0' \(see fastdecode generate --help\)$",
    ),
    ("weights-nonsense", P + ["--weights", "nonsense"], None, 1, r"argument --weights: invalid choice: 'nonsense'"),
    # issue 42, item 2: was killed by the OOM killer after 68 s at 24 GB resident
    (
        "kv-cache-gb-beyond-memory",
        P + ["--kv-cache-gb", "1e6"],
        None,
        1,
        r"--kv-cache-gb 1e\+06 needs 1e\+06 GiB but this process can have [\d.e+]+ GiB more \(",
    ),
    (
        "kv-cache-gb-too-small",
        P + ["--kv-cache-gb", "1e-9", "--max-new-tokens", "100"],
        None,
        1,
        r"may need \d+ KV blocks .* the KV cache has 1",
    ),
    (
        "draft-tree-0",
        P + ["--drafter", "ngram", "--draft-tree", "0"],
        None,
        1,
        r"argument --draft-tree: expected 'auto'",
    ),
    (
        "exit-layer-0",
        P + ["--drafter", "layer-skip", "--exit-layer", "0"],
        None,
        1,
        r"exit_layer must be in 1\.\.3, got 0",
    ),
    (
        "skip-every-layer",
        P + ["--drafter", "layer-skip", "--skip-layers", "0,1,2,3"],
        None,
        1,
        r"skip_layers must name some but not all",
    ),
    (
        "skip-layers-not-ints",
        P + ["--drafter", "layer-skip", "--skip-layers", "a,b"],
        None,
        1,
        r"argument --skip-layers: expected comma-separated integers",
    ),
    # -- flags that conflict, or that the chosen drafter would silently ignore
    ("stream-and-json", P + ["--stream", "--json"], None, 1, r"argument --json: not allowed with argument --stream"),
    (
        "ngram-n-without-ngram",
        P + ["--ngram-n", "3"],
        None,
        1,
        r"--ngram-n is an option of the ngram, recycling and hybrid drafters, not of 'none'",
    ),
    (
        "ngram-flags-with-prompt-lookup",
        P + ["--drafter", "prompt-lookup", "--ngram-min-prob", "0.5"],
        None,
        1,
        r"--ngram-min-prob is an option of the ngram drafter, not of 'prompt-lookup'",
    ),
    ("adaptive-k-without-drafter", P + ["--adaptive-k"], None, 1, r"choose a --drafter"),
    ("draft-tree-without-drafter", P + ["--draft-tree", "3"], None, 1, r"choose a --drafter"),
    (
        "adaptive-and-cost-aware",
        P + ["--drafter", "ngram", "--adaptive-k", "--cost-aware-k"],
        None,
        1,
        r"choose one draft length policy",
    ),
    (
        "draft-quant-with-ngram",
        P + ["--drafter", "ngram", "--draft-quant", "int8"],
        None,
        1,
        r"apply to the draft-model and hybrid drafters",
    ),
    (
        "exit-layer-with-ngram",
        P + ["--drafter", "ngram", "--exit-layer", "2"],
        None,
        1,
        r"apply to the layer-skip drafter",
    ),
    (
        "hf-backend-bf16-speculation",
        P + ["--backend", "hf", "--dtype", "bfloat16", "--drafter", "ngram"],
        None,
        1,
        r"token-identical only in float32",
    ),
    # -- drafter / target mismatch
    (
        "draft-model-other-vocab",
        P + ["--drafter", "draft-model", "--draft-model", "{other-vocab}"],
        None,
        1,
        r"vocabulary does not match the target's \(80 vs 64 tokens",
    ),
    ("draft-model-missing", P + ["--drafter", "draft-model", "--draft-model", "{missing}"], None, 1, r"no such file"),
    # -- quantize: outputs at existing or unwritable paths, and its own flags
    (
        "quantize-out-is-a-file",
        ["quantize", "{model}", "--method", "int8", "--out", "{a-file}"],
        None,
        1,
        r"a-file: exists and is not a directory",
    ),
    (
        "quantize-out-not-empty",
        ["quantize", "{model}", "--method", "int8", "--out", "{nonempty}"],
        None,
        1,
        r"nonempty: directory is not empty",
    ),
    (
        "quantize-out-unwritable",
        ["quantize", "{model}", "--method", "int8", "--out", "{under_file}"],
        None,
        1,
        r"cannot write the quantized model there \(Not a directory\)",
    ),
    (
        "quantize-group-size-0",
        ["quantize", "{model}", "--method", "int4", "--group-size", "0", "--out", "{new_out}"],
        None,
        1,
        r"argument --group-size: expected an integer >= 1",
    ),
    (
        "quantize-group-size-7",
        ["quantize", "{model}", "--method", "int4", "--group-size", "7", "--out", "{new_out}"],
        None,
        1,
        r"int4 group size must be one of",
    ),
    (
        "quantize-int8-group-size",
        ["quantize", "{model}", "--method", "int8", "--group-size", "32", "--out", "{new_out}"],
        None,
        1,
        r"int8 is per-channel and takes no group size",
    ),
    (
        "quantize-method",
        ["quantize", "{model}", "--method", "int5", "--out", "{new_out}"],
        None,
        1,
        r"argument --method: invalid choice",
    ),
    (
        "quantize-missing-model",
        ["quantize", "{missing}", "--method", "int8", "--out", "{new_out}"],
        None,
        1,
        r"no such file",
    ),
    # -- distill-drafter
    ("distill-out-is-a-file", _distill("--out", "{a-file}"), None, 1, r"a-file: exists and is not a directory"),
    ("distill-out-not-empty", _distill("--out", "{nonempty}"), None, 1, r"nonempty: directory is not empty"),
    (
        "distill-steps-0",
        _distill("--out", "{new_out}", "--steps", "0"),
        None,
        1,
        r"steps must be an integer >= 1, got 0",
    ),
    (
        "distill-layers-too-many",
        _distill("--out", "{new_out}", "--layers", "9"),
        None,
        1,
        r"takes 1\.\.3 of the target's 4 layers",
    ),
    ("distill-lr-nan", _distill("--out", "{new_out}", "--lr", "nan"), None, 1, r"lr must be a number > 0, got nan"),
    # -- bench: malformed prompt files, outputs, flags
    ("bench-prompts-bad-json", _bench("--prompts", "{bench-bad-json.jsonl}"), None, 1, r"line 2: not valid JSON"),
    ("bench-prompts-latin1", _bench("--prompts", "{bench-latin1.jsonl}"), None, 1, r"not UTF-8 text"),
    (
        "bench-prompts-no-prompt",
        _bench("--prompts", "{bench-no-prompt.jsonl}"),
        None,
        1,
        r'line 1: "prompt" must be a non-empty string',
    ),
    (
        "bench-prompts-empty-prompt",
        _bench("--prompts", "{bench-empty-prompt.jsonl}"),
        None,
        1,
        r'"prompt" must be a non-empty string',
    ),
    ("bench-prompts-missing", _bench("--prompts", "{missing}"), None, 1, r"cannot read prompts file"),
    (
        "bench-dataset-file-type",
        _bench("--dataset-file", "{dataset.txt}"),
        None,
        1,
        r"must end in \.json, \.jsonl or \.parquet",
    ),
    (
        "bench-out-is-a-file",
        _bench("--prompts", "{bench-good.jsonl}", "--out", "{a-file}"),
        None,
        1,
        r"exists and is not a directory",
    ),
    (
        "bench-out-not-empty",
        _bench("--prompts", "{bench-good.jsonl}", "--out", "{nonempty}"),
        None,
        1,
        r"directory is not empty",
    ),
    (
        "bench-max-new-tokens-0",
        _bench("--prompts", "{bench-good.jsonl}", "--max-new-tokens", "0"),
        None,
        1,
        r"--max-new-tokens must be >= 1, got 0",
    ),
    (
        "bench-draft-k-not-ints",
        _bench("--prompts", "{bench-good.jsonl}", "--draft-k", "x"),
        None,
        1,
        r"argument --draft-k: expected comma-separated integers",
    ),
    (
        "bench-ngram-n-1",
        _bench("--prompts", "{bench-good.jsonl}", "--ngram-n", "1"),
        None,
        1,
        r"--ngram-n must be >= 2",
    ),
    (
        "bench-unknown-drafter",
        _bench("--prompts", "{bench-good.jsonl}", "--drafters", "bogus"),
        None,
        1,
        r"unknown drafter 'bogus'",
    ),
    (
        "bench-temperature-nan",
        _bench("--prompts", "{bench-good.jsonl}", "--temperature", "nan"),
        None,
        1,
        r"temperature must be",
    ),
    # fails after --out was checked: the check must leave no directory behind
    (
        "bench-dtype-after-out-check",
        _bench("--prompts", "{bench-good.jsonl}", "--dtype", "float8"),
        None,
        1,
        r"unknown dtype",
    ),
]


@pytest.mark.parametrize(
    "argv, stdin, expected_code, pattern", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES]
)
def test_cli_bad_input_is_one_error_line(files, tmp_path, argv, stdin, expected_code, pattern):
    names = dict(files, new_out=str(tmp_path / "new-out"))
    argv = [re.sub(r"\{([\w.-]+)\}", lambda m: names[m.group(1)], a) for a in argv]
    before = {p.name for p in Path(files["a-file"]).parent.iterdir()}
    code, out, err = run_cli(argv, stdin)
    assert_one_error(code, out, err, expected_code, pattern)
    assert not (tmp_path / "new-out").exists()  # no output directory from a failed command
    assert Path(files["a-file"]).read_text() == "mine\n"
    assert [p.name for p in Path(files["nonempty"]).iterdir()] == ["notes.txt"]
    assert {p.name for p in Path(files["a-file"]).parent.iterdir()} == before  # no litter beside them


class _ClosedPipe(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_stdout_closed_by_its_reader_stops_quietly(files):
    """``fastdecode generate ... | head -c 0``: no traceback, exit 1, as other Unix tools."""
    err, saved = io.StringIO(), (sys.stdout, sys.stderr)
    sys.stdout, sys.stderr = _ClosedPipe(), err
    try:
        code = main(["generate", "--model", files["model"], "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "2"])
    finally:
        sys.stdout, sys.stderr = saved
    assert code == 1
    assert [line for line in err.getvalue().splitlines() if not line.startswith("fastdecode: note: ")] == []


def test_the_tables_are_large_enough():
    assert len(CLI_CASES) + len(API_CASES) >= 40


# ---------------------------------------------------------------- the hub, unreachable


def test_hub_offline_and_not_cached_is_one_line(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run_cli(["generate", "--model", "someorg/somemodel", "--prompt", PROMPT])
    assert_one_error(
        code,
        out,
        err,
        1,
        r"someorg/somemodel: the Hugging Face hub cannot be reached "
        r"\(offline mode is on: HF_HUB_OFFLINE is set\) and the model is not in the local cache",
    )


def test_hub_offline_loads_a_cached_model(monkeypatch, tmp_path, files):
    """Offline, a hub id in the local cache still loads (huggingface_hub's own cache layout)."""
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someorg--tiny"
    shutil.copytree(files["model"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run_cli(
        ["generate", "--model", "someorg/tiny", "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "3", "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["num_new_tokens"] >= 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


HUB_UNREACHABLE = (
    r"someorg/somemodel: the Hugging Face hub cannot be reached \(ConnectError: .*\) "
    r"and the model is not in the local cache"
)


def test_hub_unreachable_is_one_line_and_no_retries_in_this_process(monkeypatch, tmp_path):
    """The hub pointed at a closed local port, as HF_ENDPOINT would point it (read when
    huggingface_hub is imported: the process test below sets the variable itself):
    huggingface_hub would retry for ~25 s and print each try; fastdecode asks once, quietly."""
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run_cli(["generate", "--model", "someorg/somemodel", "--prompt", PROMPT])
    assert_one_error(code, out, err, 1, HUB_UNREACHABLE)


def test_hub_unreachable_is_one_line_and_no_retries(tmp_path, child_process_env):
    """A real process with the hub pointed at a closed local port: huggingface_hub would retry
    for ~25 s and print each try; fastdecode asks once, quietly, and says what happened."""
    env = dict(
        child_process_env,
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        HF_HOME=str(tmp_path / "hf"),
        OMP_NUM_THREADS="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "fastdecode.cli", "generate", "--model", "someorg/somemodel", "--prompt", PROMPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_error(
        proc.returncode,
        proc.stdout,
        proc.stderr,
        1,
        HUB_UNREACHABLE,
    )


# ---------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def api(files):
    from fastdecode import load_model

    model, tok = load_model(files["model"])
    other, other_tok = load_model(files["other-vocab"])
    return SimpleNamespace(files=files, model=model, tok=tok, other=other, other_tok=other_tok)


def _engine(a, **kwargs):
    from fastdecode import accelerate

    return accelerate(a.model, a.tok, drafter=None, **kwargs)


def _gen_api(a, prompt=PROMPT, **options):
    return _engine(a).generate(prompt, chat=False, max_new_tokens=options.pop("max_new_tokens", 4), **options)


def _load(spec, **kwargs):
    from fastdecode import load_model

    return load_model(spec, **kwargs)


def _save_unquantized(a, out):
    from fastdecode.quant import Int8WeightOnlyConfig, save_quantized

    return save_quantized(a.model, None, out, Int8WeightOnlyConfig())


def _save_quantized_to(a, out):
    import copy

    from fastdecode.quant import Int8WeightOnlyConfig, quantize_, save_quantized

    model = copy.deepcopy(a.model)
    quantize_(model, Int8WeightOnlyConfig())
    return save_quantized(model, None, out, Int8WeightOnlyConfig())


API_CASES = [
    pytest.param(lambda a: _load(a.files["missing"]), ModelLoadError, r"no such file or directory", id="load-missing"),
    pytest.param(
        lambda a: _load(None), ConfigError, r"a model spec is a name, a path or a hub id, got None", id="load-spec-none"
    ),
    pytest.param(lambda a: _load(3), ConfigError, r"a model spec is .* got 3", id="load-spec-int"),
    pytest.param(lambda a: _load(""), ModelLoadError, r"empty or unreadable model spec", id="load-spec-empty"),
    pytest.param(lambda a: _load(a.files["model"], dtype=5), ConfigError, r"unknown dtype 5", id="load-dtype-int"),
    pytest.param(
        lambda a: _load(a.files["model"], dtype="int3"), ConfigError, r"unknown dtype 'int3'", id="load-dtype-name"
    ),
    pytest.param(
        lambda a: _load(a.files["model"], device="tpu"), ConfigError, r"unknown device 'tpu'", id="load-device"
    ),
    pytest.param(
        lambda a: _load(a.files["corrupt-weights"]), ModelLoadError, r"cannot load the model", id="load-corrupt"
    ),
    pytest.param(lambda a: _load(a.files["other-arch"]), ModelLoadError, r"weights do not match", id="load-other-arch"),
    pytest.param(lambda a: _load(a.files["vit"]), ModelLoadError, r"unsupported architecture 'vit'", id="load-vit"),
    pytest.param(
        lambda a: _load("someorg/x", dtype="float8"), ConfigError, r"unknown dtype", id="load-hub-bad-dtype-first"
    ),
    pytest.param(lambda a: _engine(a, backend="tpu"), ConfigError, r"unknown backend 'tpu'", id="accelerate-backend"),
    pytest.param(
        lambda a: _engine(a, float_kernel="x"), ConfigError, r"unknown float kernel 'x'", id="accelerate-float-kernel"
    ),
    pytest.param(
        lambda a: _engine(a, kv_cache_dtype="int8"),
        ConfigError,
        r"unknown KV cache dtype 'int8'",
        id="accelerate-kv-dtype",
    ),
    pytest.param(
        lambda a: _engine(a, kv_cache_dtype="bfloat16"),
        ConfigError,
        r"KV cache in float32 or float16",
        id="accelerate-kv-dtype-kernels",
        marks=pytest.mark.skipif(
            platform.machine().lower() not in ("x86_64", "amd64"), reason="fastdecode's CPU kernels are x86-64"
        ),
    ),
    pytest.param(
        lambda a: _engine(a, max_num_seqs=0),
        ConfigError,
        r"max_num_seqs must be an integer >= 1",
        id="accelerate-seqs-0",
    ),
    pytest.param(
        lambda a: _engine(a, kv_cache_gb=float("nan")),
        ConfigError,
        r"kv_cache_gb must be a number > 0",
        id="accelerate-kv-nan",
    ),
    pytest.param(
        lambda a: _engine(a, kv_cache_gb=1e-9).generate(PROMPT, chat=False),
        ConfigError,
        r"KV blocks",
        id="engine-kv-too-small",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").accelerate(a.model, a.tok, drafter="bogus"),
        ConfigError,
        r"unknown drafter 'bogus'",
        id="accelerate-drafter-name",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").accelerate(a.model, a.tok, drafter="ngram", n=1),
        ConfigError,
        r"order N must be an integer >= 2",
        id="accelerate-ngram-n-1",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").accelerate(a.model, a.tok, drafter="ngram", k=0),
        ConfigError,
        r"k must be an integer >= 1",
        id="accelerate-k-0",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").build_drafter("prompt-lookup", max_ngram_size=0),
        ConfigError,
        r"max_ngram_size must be",
        id="prompt-lookup-ngram-size-0",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").Engine(
            a.model,
            a.tok,
            drafter=__import__("fastdecode").build_drafter("draft-model", model=a.other, tokenizer=a.other_tok),
        ),
        IncompatibleDrafterError,
        r"vocabulary does not match",
        id="draft-model-vocab-mismatch",
    ),
    pytest.param(
        lambda a: _gen_api(a, temperature=-1), ConfigError, r"temperature must be", id="gen-temperature-negative"
    ),
    pytest.param(
        lambda a: _gen_api(a, temperature="hot"), ConfigError, r"temperature must be", id="gen-temperature-str"
    ),
    pytest.param(lambda a: _gen_api(a, top_p=0), ConfigError, r"top_p must be in", id="gen-top-p-0"),
    pytest.param(lambda a: _gen_api(a, top_k=1.5), ConfigError, r"top_k must be an integer", id="gen-top-k-float"),
    pytest.param(
        lambda a: _gen_api(a, temperature=1.0, seed=2**64),
        ConfigError,
        r"seed must be an integer in \[0, 2\*\*64\)",
        id="gen-seed-2**64",
    ),
    pytest.param(lambda a: _gen_api(a, max_new_tokens=0), ConfigError, r"max_new_tokens must be", id="gen-max-new-0"),
    pytest.param(
        lambda a: _gen_api(a, temprature=1),
        ConfigError,
        r"unknown generation option\(s\): temprature",
        id="gen-unknown-option",
    ),
    pytest.param(lambda a: _gen_api(a, ""), ConfigError, r"the prompt is empty", id="gen-empty-prompt"),
    pytest.param(
        lambda a: _gen_api(a, [1, 999]), ConfigError, r"token id 999 is outside the vocabulary", id="gen-ids-oov"
    ),
    pytest.param(
        lambda a: _gen_api(a, " ".join(["w1"] * 200)), PromptTooLongError, r"context length is 128", id="gen-too-long"
    ),
    pytest.param(
        lambda a: _engine(a).generate(PROMPT, chat=True), ConfigError, r"no chat template", id="gen-chat-no-template"
    ),
    pytest.param(lambda a: _gen_api(a, stop=[""]), ConfigError, r"stop strings must be non-empty", id="gen-stop-empty"),
    pytest.param(
        lambda a: _gen_api(a, adaptive_k=True, cost_aware_k=True),
        ConfigError,
        r"choose one draft length policy",
        id="gen-two-k-policies",
    ),
    pytest.param(lambda a: _gen_api(a, draft_tree=0), ConfigError, r"draft_tree must be", id="gen-draft-tree-0"),
    pytest.param(
        lambda a: _save_unquantized(a, Path(a.files["missing"]) / "q"),
        ConfigError,
        r"no quantized layers",
        id="save-quantized-unquantized",
    ),
    pytest.param(
        lambda a: _save_quantized_to(a, a.files["under_file"]),
        ConfigError,
        r"cannot write there \(.*a-file is not a directory\)",
        id="save-quantized-unwritable",
    ),
    # -- found by the issue-15 suite in the engine and drafters, fixed since
    pytest.param(
        lambda a: __import__("fastdecode").accelerate(a.model, a.tok, drafter="ngram", nn=3),
        ConfigError,
        r"nn",
        id="accelerate-unknown-drafter-option",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").accelerate(a.model, a.tok, drafter="ngram", min_prob="x"),
        ConfigError,
        r"min_prob",
        id="accelerate-min-prob-str",
    ),
    pytest.param(
        lambda a: _engine(a, kv_cache_gb=float("inf")).generate(PROMPT, chat=False),
        ConfigError,
        r"kv_cache_gb",
        id="engine-kv-inf",
    ),
    pytest.param(
        lambda a: _gen_api(a, None),
        ConfigError,
        r"prompt",
        id="gen-prompt-none",
    ),
    pytest.param(
        lambda a: _gen_api(a, [1.5, 2.5]),
        ConfigError,
        r"token",
        id="gen-ids-float",
    ),
    pytest.param(
        lambda a: _gen_api(a, "w1 \udcff"),
        ConfigError,
        r"UTF-8",
        id="gen-prompt-surrogate",
    ),
    pytest.param(
        lambda a: _gen_api(a, stop=5),
        ConfigError,
        r"stop",
        id="gen-stop-int",
    ),
    pytest.param(
        lambda a: _engine(a).generate(PROMPT, {"max_new_tokens": 3}),
        ConfigError,
        r"config",
        id="gen-config-dict",
    ),
    pytest.param(
        lambda a: __import__("fastdecode").Engine(a.model, a.tok, drafter="ngram"),
        ConfigError,
        r"drafter",
        id="engine-drafter-name",
    ),
]


@pytest.mark.parametrize("call, error, pattern", API_CASES)
def test_api_bad_input_raises_one_clear_error(api, call, error, pattern):
    with pytest.raises(error, match=pattern) as exc:
        call(api)
    assert isinstance(exc.value, FastDecodeError)
    assert "\n" not in str(exc.value)


def test_accelerate_passes_a_draft_models_own_model_keyword_to_the_drafter(api):
    """The target's model and tokenizer are positional, so ``model=`` reaches the draft-model drafter."""
    engine = __import__("fastdecode").accelerate(api.model, api.tok, drafter="draft-model", model=api.other)
    assert engine.drafter.name == "draft-model" and engine.drafter.draft is not None
