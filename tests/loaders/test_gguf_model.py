"""A GGUF skeleton against transformers' GGUF loader on the embedded file: the same config, the same
float weights when materialized (bit for bit), the same tokenizer; and the blocks path builds no float."""

from __future__ import annotations

import pytest
import torch

from fastdecode.loaders.gguf_config import gguf_config
from fastdecode.loaders.gguf_file import GGUFFile
from fastdecode.loaders.gguf_model import is_lazy, materialize
from fastdecode.loading import BUILTIN_MODELS, load_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def path():
    return BUILTIN_MODELS["smollm2-135m"].locate()


def test_config_is_transformers_own(path):
    from transformers import AutoConfig

    ours = gguf_config(GGUFFile(path)).to_dict()
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    ours.pop("_name_or_path"), theirs.pop("_name_or_path")
    assert ours == theirs


def test_materialized_weights_are_transformers_own(path):
    from transformers import AutoModelForCausalLM

    model, _ = load_model("smollm2-135m", lazy=True)
    assert is_lazy(model)
    materialize(model)
    assert not is_lazy(model)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_tokenizer_is_transformers_own(path, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    built = load_model("smollm2-135m")[1]  # from the file's metadata
    cached = load_model("smollm2-135m")[1]  # read back from the cache
    chat = [{"role": "user", "content": "Hi there"}]
    for tok in (built, cached):
        assert type(tok.transformers_tokenizer()) is type(theirs)  # tok reads its files without transformers
        for text in ("Hello world", "def f(x):\n\treturn x  # ünïcödé 日本語", "<|im_start|>user\nhi<|im_end|>"):
            assert tok(text)["input_ids"] == theirs(text)["input_ids"]
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        assert (tok.eos_token_id, tok.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)


def test_gguf_weights_build_no_float_model():
    from fastdecode.backends import make_target

    model, tok = load_model("smollm2-135m", lazy=True)
    target = make_target(model, "native", "gguf", tokenizer=tok)
    assert is_lazy(model)  # the blocks came from the file; no weight was dequantized into the model
    assert target.weights == "gguf:q4_1+q8_0"
    ids = torch.tensor([1, 2, 3])
    float_rows = GGUFFile(BUILTIN_MODELS["smollm2-135m"].locate()).values("token_embd.weight")[[1, 2, 3]]
    assert torch.equal(target.embed[ids], torch.from_numpy(float_rows))
