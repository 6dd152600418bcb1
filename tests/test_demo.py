"""``fastdecode demo`` on a tiny local model directory: the target options reach make_target."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import fastdecode.demo as demo
from fastdecode.cli import main


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    # The suite's prompts are mostly <unk> here: a short sequence, which is all the demo needs.
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(61)]])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-demo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def make_target_calls(monkeypatch):
    calls = []
    real = demo.make_target

    def spy(*args, **kwargs):
        calls.append((args[1:], kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "make_target", spy)
    return calls


def test_run_demo_builds_its_target_with_the_float_kernel(model_dir, make_target_calls, capsys):
    code = demo.run_demo(str(model_dir), max_new_tokens=4, backend="native", float_kernel="torch")
    out = capsys.readouterr().out
    assert code == 0, out
    assert make_target_calls == [(("native", "float", "torch", "auto"), {})]
    assert "backend native, weights float, dtype float32, torch kernels" in out


def test_demo_command_passes_float_kernel(model_dir, make_target_calls, capsys):
    code = main(["demo", "--model", str(model_dir), "--max-new-tokens", "4", "--backend", "native", "--float-kernel", "torch",
                 "--kv-cache-dtype", "float16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert make_target_calls == [(("native", "float", "torch", "float16"), {})]
    assert "torch kernels" in out
