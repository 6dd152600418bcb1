"""``fastdecode bench --long-context`` end to end at tiny sizes: every cache type and prompt
length measured, prompts cut to the model's context, cache sizes as stored, quality against a
float32 cache. (Figures are not checked: a benchmark asserts nothing about speed.)"""

import json

import pytest

from fastdecode.bench.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import save_tiny_llama

    return save_tiny_llama(  # its word-level tokenizer reads most of WikiText-2 as <unk>: fine for a harness
        tmp_path_factory.mktemp("tiny-llama-32"),
        hidden_size=32,
        num_attention_heads=1,  # head_dim 32: rows of one q8_0 / q4_0 block
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
    )


def test_long_context_bench_at_tiny_sizes(model_dir, tmp_path, capsys, short_evaluation_text):
    argv = ["bench", "--long-context", "--model", str(model_dir), "--context-tokens", "48,200"]
    argv += ["--decode-tokens", "4", "--kv-cache-dtypes", "float32,q8_0,q4_0", "--ppl-window", "64"]
    argv += ["--ppl-windows", "1", "--peers", "llama-cpp", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    run = json.loads((tmp_path / "long_context.json").read_text())
    speed = {(r["kv_cache_dtype"], r["context_tokens"]): r for r in run["speed"]}
    assert set(speed) == {(kv, c) for kv in ("float32", "q8_0", "q4_0") for c in (48, 200)}
    assert speed["q8_0", 200]["prompt_tokens"] == 128 - 4 - 1  # cut to leave room for the new tokens
    # one KV head of 32 values a row, 2 layers, K and V: 128, 34 and 18 bytes a row
    mib = {kv: speed[kv, 48]["kv_cache_mib"] for kv in ("float32", "q8_0", "q4_0")}
    assert mib["q8_0"] * 128 == pytest.approx(mib["float32"] * 34)
    assert mib["q4_0"] * 128 == pytest.approx(mib["float32"] * 18)
    quality = {r["kv_cache_dtype"]: r for r in run["quality"]}
    assert quality["float32"]["top1_agreement"] == 1.0 and quality["float32"]["kl"] == 0.0
    assert quality["q4_0"]["num_tokens"] == 63 and quality["q4_0"]["kl"] >= 0.0
    # (the model is no GGUF file; where llama-cpp-python is absent, as on a fresh CI clone, that is said first)
    assert any("not a GGUF file" in note or "llama-cpp-python is not installed" in note for note in run["notes"])
    out = capsys.readouterr().out
    assert "| fastdecode | q4_0 | full | 200 | 123 |" in out and (tmp_path / "long_context.md").exists()


def test_long_context_options_are_checked(model_dir, tmp_path):
    base = ["bench", "--long-context", "--model", str(model_dir), "--out", str(tmp_path), "--no-progress"]
    assert main([*base, "--kv-cache-dtypes", "q9_0"]) != 0
    assert main([*base, "--weights", "float,int8"]) != 0  # one numeric model a run


def test_each_llama_cpp_request_prefills_its_whole_prompt():
    """llama-cpp-python reuses the longest prefix it already evaluated, even with reset=True:
    every request resets it first, so its prefill time covers the whole prompt."""
    from fastdecode.bench.long_context import _llama_cpp_request

    calls = []

    class FakeLlama:
        def reset(self):
            calls.append("reset")

        def generate(self, prompt, **kw):
            calls.append(("generate", len(prompt)))
            yield from range(10)

    assert _llama_cpp_request(FakeLlama(), list(range(12)), 4)[0] == 4
    assert calls == ["reset", ("generate", 12)]
