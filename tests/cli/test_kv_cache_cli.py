"""--kv-cache-dtype q8_0 | q4_0 from the command line: generate (one prompt and a batch file) on
the native target, token-identical with a drafter; one clear error on the transformers target."""

import json

import pytest
from tiny_models import save_tiny_llama

from fastdecode.cli import main

PROMPT = " ".join(f"w{i % 7}" for i in range(30))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # head_dim 32: rows of one quantized block
    return save_tiny_llama(tmp_path_factory.mktemp("tiny32"), num_attention_heads=2, num_key_value_heads=1)


def _generate(capsys, model_dir, *args):
    code = main(["generate", "--model", str(model_dir), "--no-chat", "--max-new-tokens", "16", "--json", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "q8_0/q4_0"])
def test_generate_with_a_quantized_cache_and_a_drafter_equals_plain(capsys, model_dir, kv):
    code, plain, err = _generate(capsys, model_dir, "--prompt", PROMPT, "--kv-cache-dtype", kv)
    assert code == 0, err
    code, spec, err = _generate(capsys, model_dir, "--prompt", PROMPT, "--kv-cache-dtype", kv, "--drafter", "ngram")
    assert code == 0, err
    plain, spec = json.loads(plain), json.loads(spec)
    assert spec["token_ids"] == plain["token_ids"] and spec["kv_cache_dtype"] == kv


def test_a_batch_file_with_a_quantized_cache(capsys, model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT, "w1 w2 w3 w1 w2 w3 w1")))
    code, out, err = _generate(capsys, model_dir, "--prompts-file", str(prompts), "--kv-cache-dtype", "q4_0")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 2


def test_the_transformers_target_refuses_a_quantized_cache(capsys, model_dir):
    code, _, err = _generate(capsys, model_dir, "--prompt", PROMPT, "--backend", "hf", "--kv-cache-dtype", "q8_0")
    assert code != 0 and "--kv-cache-dtype q8_0 needs the native backend" in err and "Traceback" not in err
