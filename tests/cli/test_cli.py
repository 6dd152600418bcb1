"""The command line on a tiny local model directory (in-process, fast)."""

import json

import pytest
from tiny_models import save_tiny_llama

from fastdecode.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4)


PROMPT = " ".join(f"w{i % 7}" for i in range(30))


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def generate_json(capsys, model_dir, *args):
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        PROMPT,
        "--no-chat",
        "--max-new-tokens",
        "24",
        "--json",
        *args,
    )
    assert code == 0, err
    return json.loads(out)


DRAFTER_ARGS = [
    ["--drafter", "ngram"],
    ["--drafter", "prompt-lookup", "--draft-k", "4"],
    ["--drafter", "draft-model", "--draft-k", "3"],
    ["--drafter", "draft-model", "--draft-quant", "int8"],
    ["--drafter", "draft-model", "--draft-quant", "int4"],
    ["--drafter", "draft-model", "--draft-quant", "q4_0"],  # the target on integer dot products drafting for itself
    ["--drafter", "hybrid", "--draft-quant", "q4_0", "--ngram-n", "3"],
    ["--drafter", "layer-skip", "--exit-layer", "2"],
    ["--drafter", "layer-skip", "--skip-layers", "1,2", "--adaptive-k"],
]


@pytest.mark.parametrize("backend,drafter_args", [(b, a) for b in ("native", "hf") for a in DRAFTER_ARGS])
def test_every_drafter_from_the_cli_matches_plain(capsys, model_dir, drafter_args, backend):
    # layer-skip always drafts on the native decoder; what varies is the target's backend
    plain = generate_json(capsys, model_dir, "--backend", backend)
    spec = generate_json(capsys, model_dir, "--backend", backend, *drafter_args)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["drafter"] == drafter_args[1]
    assert spec["acceptance"]["drafted_tokens"] > 0
    assert spec["backend"] == backend


def test_self_drafting_accepts_every_token(capsys, model_dir):
    out = generate_json(capsys, model_dir, "--drafter", "draft-model", "--draft-k", "4")
    assert out["acceptance"]["acceptance_rate"] == 1.0


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_low_bit_targets_stay_lossless_for_their_own_numerics(capsys, model_dir, weights):
    plain = generate_json(capsys, model_dir, "--weights", weights)
    spec = generate_json(capsys, model_dir, "--weights", weights, "--drafter", "ngram")
    assert plain["weights"] == weights and plain["backend"] == "native"
    assert spec["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("args", [["--weights", "int8"], ["--weights", "int4"], ["--dtype", "bfloat16"]])
def test_transformers_backend_refuses_speculation_it_cannot_keep_lossless(capsys, model_dir, args):
    plain = generate_json(capsys, model_dir, "--backend", "hf", *args)  # plain decoding is fine
    assert plain["backend"] == "hf"
    code, _, err = run(
        capsys,
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        PROMPT,
        "--backend",
        "hf",
        "--drafter",
        "ngram",
        *args,
    )
    assert code == 1 and "token-identical only in float32" in err


def test_quantize_save_load_generate_round_trip(capsys, model_dir, tmp_path):
    out_dir = tmp_path / "q"
    code, out, err = run(
        capsys, "quantize", str(model_dir), "--method", "int4", "--include-lm-head", "--out", str(out_dir)
    )
    assert code == 0, err
    assert "MB ->" in out and "perplexity on the built-in text" in out
    first = generate_json(capsys, out_dir)
    again = generate_json(capsys, out_dir, "--drafter", "ngram")
    assert first["token_ids"] == again["token_ids"]


@pytest.mark.parametrize("flag, head", [(None, "w8a8"), ("--no-include-lm-head", None)])
def test_smoothquant_compresses_the_lm_head_unless_told_not_to(capsys, model_dir, tmp_path, flag, head):
    out_dir = tmp_path / "sq"
    args = ["compress", str(model_dir), "--method", "smoothquant", "--eval-windows", "0", "--out", str(out_dir)]
    code, _, err = run(capsys, *args, *([flag] if flag else []))
    assert code == 0, err
    layers = json.loads((out_dir / "fastdecode_quant.json").read_text())["layers"]
    assert layers.get("lm_head", {}).get("kind") == head
    assert {layer["kind"] for name, layer in layers.items() if name != "lm_head"} == {"w8a8"}


def test_pruning_then_smoothquant_compresses_the_lm_head(capsys, model_dir, tmp_path):
    out_dir = tmp_path / "pruned_sq"
    args = ["compress", str(model_dir), "--method", "magnitude", "--then", "smoothquant", "--eval-windows", "0"]
    code, _, err = run(capsys, *args, "--out", str(out_dir))
    assert code == 0, err
    layers = json.loads((out_dir / "fastdecode_quant.json").read_text())["layers"]
    assert layers.get("lm_head", {}).get("kind") == "w8a8"  # smoothquant's default, as README says


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--drafter", "ngram", "--draft-quant", "int4"], "apply to the draft-model and hybrid drafters"),
        (["--drafter", "ngram", "--exit-layer", "2"], "apply to the layer-skip drafter"),
        (["--drafter", "layer-skip", "--exit-layer", "9"], "exit_layer must be in"),
        (["--backend", "native", "--weights", "float", "--device", "cuda:7"], "cuda"),
    ],
)
def test_bad_drafter_settings(capsys, model_dir, args, pattern):
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", PROMPT, *args)
    assert code == 1
    assert err.startswith("fastdecode: error:") and pattern in err and "Traceback" not in err


@pytest.mark.parametrize("float_kernel", ["auto", "torch"])
def test_float_kernel_choice_is_reported_and_lossless(capsys, model_dir, float_kernel):
    from fastdecode.kernels.cpu import rowgemm_unavailable

    plain = generate_json(capsys, model_dir, "--float-kernel", float_kernel)
    spec = generate_json(capsys, model_dir, "--float-kernel", float_kernel, "--drafter", "ngram")
    expected = "rowgemm" if float_kernel == "auto" and rowgemm_unavailable() is None else "torch"
    assert plain["float_kernel"] == spec["float_kernel"] == expected
    assert spec["token_ids"] == plain["token_ids"]
    int8 = generate_json(capsys, model_dir, "--float-kernel", float_kernel, "--weights", "int8")
    assert int8["float_kernel"] == expected and int8["weights"] == "int8"
    assert generate_json(capsys, model_dir, "--float-kernel", float_kernel, "--weights", "int4")["float_kernel"] is None


def test_float_kernel_rowgemm_refused_where_it_cannot_run(capsys, model_dir):
    code, _, err = run(
        capsys,
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        PROMPT,
        "--dtype",
        "bfloat16",
        "--float-kernel",
        "rowgemm",
    )
    assert code == 1 and "--float-kernel rowgemm cannot run here" in err


def test_a_kernel_that_cannot_be_built_is_noted_not_hidden(capsys, model_dir, monkeypatch):
    from fastdecode.kernels import cpu

    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu._load.cache_clear()
    try:
        code, out, err = run(
            capsys,
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            PROMPT,
            "--no-chat",
            "--max-new-tokens",
            "4",
            "--json",
            "--drafter",
            "ngram",
        )
    finally:
        monkeypatch.undo()
        cpu._load.cache_clear()
    assert code == 0 and json.loads(out)["float_kernel"] == "torch"
    assert "fastdecode: note: running torch's float32 kernels (no C compiler" in err


def _prompts_file(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


@pytest.mark.parametrize(
    "extra", [["--max-num-seqs", "3"], ["--max-num-seqs", "1"], ["--drafter", "ngram", "--max-num-seqs", "4"]]
)
def test_prompts_file_results_in_input_order_equal_one_at_a_time(capsys, model_dir, tmp_path, extra):
    prompts = [" ".join(f"w{(i * j + 3) % 11}" for i in range(5 + 3 * j)) for j in range(6)]
    lines = [{"prompt": p, "id": f"q{j}"} for j, p in enumerate(prompts)]
    lines[2]["max_new_tokens"] = 5
    lines[4].update(temperature=0.8, seed=11)
    path = _prompts_file(tmp_path, lines)
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(model_dir),
        "--prompts-file",
        str(path),
        "--no-chat",
        "--max-new-tokens",
        "20",
        *extra,
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in records] == list(range(len(prompts)))
    assert [r["id"] for r in records] == [f"q{j}" for j in range(len(prompts))]
    assert records[2]["num_new_tokens"] <= 5
    for j, (record, prompt) in enumerate(zip(records, prompts)):
        args = ["--max-new-tokens", str(lines[j].get("max_new_tokens", 20))]
        if "seed" in lines[j]:
            args += ["--temperature", "0.8", "--seed", "11"]
        code, out, err = run(
            capsys, "generate", "--model", str(model_dir), "--prompt", prompt, "--no-chat", "--json", *args
        )
        assert code == 0, err
        assert json.loads(out)["token_ids"] == record["token_ids"], j


@pytest.mark.parametrize(
    "content, pattern",
    [
        (b'{"prompt": "w1 w2"}\n{"prompt": \n', r"prompts\.jsonl:2: not valid JSON"),
        (b'{"text": "w1"}\n', r'prompts\.jsonl:1: expected a JSON object with a non-empty string "prompt"'),
        (b'{"prompt": "w1", "temprature": 0.5}\n', r"prompts\.jsonl:1: unknown key\(s\) temprature"),
        (b'{"prompt": "w1", "temperature": -1}\n', r"prompts\.jsonl:1: .*temperature"),
        (b"\n\n", r"no prompts"),
        (b'\xff\xfe{"prompt": "w1"}\n', r"not UTF-8 text \(byte offset 0\)"),
    ],
)
def test_prompts_file_bad_lines_are_one_error(capsys, model_dir, tmp_path, content, pattern):
    import re

    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompts-file", str(path), "--no-chat")
    assert code == 1 and out == ""
    assert err.startswith("fastdecode: error:") and len(err.strip().splitlines()) == 1, err
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-num-seqs", "0"),
        ("--max-num-seqs", "x"),
        ("--kv-cache-gb", "0"),
        ("--kv-cache-gb", "nan"),
        ("--kv-cache-gb", "-1"),
    ],
)
def test_batching_flags_out_of_range_are_usage_errors(capsys, model_dir, flag, value):
    assert main(["generate", "--model", str(model_dir), "--prompt", PROMPT, flag, value]) == 1
    err = capsys.readouterr().err
    assert flag in err and err.startswith("fastdecode: error: ") and len(err.splitlines()) == 1


def test_kv_cache_budget_too_small_for_a_request_is_refused(capsys, model_dir):
    code, _, err = run(
        capsys, "generate", "--model", str(model_dir), "--prompt", PROMPT, "--no-chat", "--kv-cache-gb", "0.000001"
    )
    assert code == 1 and "KV blocks" in err, err


def test_a_draft_model_on_gguf_blocks_of_a_non_gguf_model_says_what_it_runs(capsys, model_dir):
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        PROMPT,
        "--no-chat",
        "--max-new-tokens",
        "8",
        "--json",
        "--drafter",
        "draft-model",
        "--draft-quant",
        "gguf",
    )
    assert code == 0, err
    assert "note: draft model: --draft-quant gguf: the model was not loaded from a GGUF file" in err
    assert json.loads(out)["acceptance"]["drafted_tokens"] > 0


# ---------------------------------------------------------------- eval and compress

EVAL_TEXT = " ".join(f"w{(i * 7) % 13}" for i in range(150))
QUALITY_FIELDS = {"perplexity", "top1_agreement", "kl", "weight_bytes", "decode_tokens_per_s"}


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(EVAL_TEXT, encoding="utf-8")
    return path


def eval_json(capsys, model, eval_text, *args):
    code, out, err = run(
        capsys, "eval", str(model), "--text", str(eval_text), "--window", "32", "--decode-tokens", "4", "--json", *args
    )
    assert code == 0, err
    return json.loads(out)


def test_eval_json_reports_the_quality_of_the_model_as_it_runs(capsys, model_dir, eval_text):
    float_ = eval_json(capsys, model_dir, eval_text, "--max-windows", "2")
    assert set(float_) >= QUALITY_FIELDS
    assert float_["window_tokens"] == float_["stride_tokens"] == 32
    assert float_["num_windows"] == 2 and float_["num_tokens"] == 2 * 31  # each window's first token has no context
    assert float_["text_tokens"] == 150  # one token a word (this tokenizer adds no BOS)
    assert float_["weights"] == "float" and float_["top1_agreement"] == 1.0 and float_["kl"] == 0.0
    q4 = eval_json(capsys, model_dir, eval_text, "--max-windows", "2", "--weights", "q4_0")
    assert q4["weights"] == "q4_0" and q4["reference_weights"] == "float"
    assert q4["kl"] > 0 and q4["weight_bytes"] < float_["weight_bytes"]
    assert q4["reference_perplexity"] == pytest.approx(float_["perplexity"], rel=1e-6)


def test_compress_is_quantize_renamed_and_reports_quality(capsys, model_dir, eval_text, tmp_path):
    from fastdecode.cli.commands import build_parser, cmd_compress

    parser = build_parser()
    for name in ("compress", "quantize"):
        args = parser.parse_args([name, str(model_dir), "--method", "int8", "--out", str(tmp_path / name)])
        assert args.func is cmd_compress and args.eval_windows == 2
    code, out, err = run(
        capsys,
        "compress",
        str(model_dir),
        "--method",
        "int8",
        "--out",
        str(tmp_path / "c"),
        "--text",
        str(eval_text),
        "--window",
        "32",
        "--eval-windows",
        "1",
    )
    assert code == 0, err
    assert "(int8): weights" in out and f"perplexity on {eval_text} (1 window(s) of 32 tokens)" in out
    assert "top-1 agreement" in out and "runs as int8" in out
    saved = eval_json(capsys, tmp_path / "c", eval_text, "--max-windows", "1", "--reference", str(model_dir))
    assert saved["weights"].startswith("int8") and saved["kl"] > 0


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--text", "{missing}"], "--text"),
        (["--text", "{binary}"], "not UTF-8"),
        (["--text", "{empty}"], "empty"),
        (["--window", "1"], "--window"),
        (["--max-windows", "0"], "--max-windows"),
    ],
)
def test_a_bad_text_or_window_is_a_usage_error(capsys, model_dir, tmp_path, args, pattern):
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "empty").write_text(" \n", encoding="utf-8")
    args = [a.format(missing=tmp_path / "nope", binary=tmp_path / "binary", empty=tmp_path / "empty") for a in args]
    assert main(["eval", str(model_dir), *args]) == 1
    err = capsys.readouterr().err
    assert pattern in err and len(err.splitlines()) == 1


def test_a_window_longer_than_the_context_is_one_error(capsys, model_dir, eval_text):
    code, out, err = run(capsys, "eval", str(model_dir), "--text", str(eval_text), "--window", "4096")
    assert code == 1 and out == ""
    assert err.startswith("fastdecode: error:") and "context length 128" in err and len(err.splitlines()) == 1


def test_compress_saves_compressed_tensors_that_load_back(capsys, model_dir, tmp_path):
    out_dir = tmp_path / "ct"
    code, _, err = run(
        capsys,
        "compress",
        str(model_dir),
        "--method",
        "q4_0",
        "--save-format",
        "compressed-tensors",
        "--eval-windows",
        "0",
        "--out",
        str(out_dir),
    )
    assert code == 0, err
    config = json.loads((out_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    first = generate_json(capsys, out_dir)
    assert first["weights"].startswith("q4_0")
    assert generate_json(capsys, out_dir, "--drafter", "ngram")["token_ids"] == first["token_ids"]


def test_compressed_tensors_output_of_a_format_it_cannot_hold_is_refused_first(capsys, model_dir, tmp_path):
    code, _, err = run(
        capsys,
        "compress",
        str(model_dir),
        "--method",
        "q4_1",
        "--save-format",
        "compressed-tensors",
        "--out",
        str(tmp_path / "x"),
    )
    assert code == 1 and "no exact compressed-tensors form" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


# -- issue 42, item 8: a clamped value says so on stderr ------------------------------------------
@pytest.mark.parametrize(
    "args, note",
    [
        (["--max-new-tokens", "1000000000"], r"--max-new-tokens 1000000000: the model's context is 128 tokens"),
        (
            ["--drafter", "ngram", "--draft-k", "10000", "--max-new-tokens", "8"],
            r"--draft-k 10000: a step verifies at most 255 draft tokens",
        ),
        # (a few tokens: on a busy machine the context's worth, on every core, took many seconds)
        (
            ["--threads", "999", "--max-new-tokens", "8"],
            r"--threads 999: this process may run on \d+ CPUs; using \d+ threads",
        ),
    ],
)
def test_a_clamped_value_says_so(capsys, model_dir, monkeypatch, args, note):
    import re

    import fastdecode.kernels.threads as threads

    monkeypatch.setattr(threads._pool, "requested", None)  # (--threads is remembered for the process)
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", PROMPT, "--no-chat", *args)
    assert code == 0 and out.strip(), err
    notes = [line for line in err.splitlines() if line.startswith("fastdecode: note: ")]
    assert any(re.search(note, line) for line in notes), err


def test_running_out_of_memory_is_one_error_line(capsys):
    from fastdecode.util.commands import ArgumentParser, run_main

    parser = ArgumentParser(prog="fastdecode")

    def allocate(args):
        raise MemoryError

    parser.set_defaults(func=allocate)
    assert run_main(parser, []) == 1
    err = capsys.readouterr().err
    assert err.startswith("fastdecode: error: out of memory") and len(err.splitlines()) == 1
