"""The default weights (``auto``) on the embedded SmolLM2-135M Q4_1 GGUF: the file's own blocks, at the
size of the file, with no float copy of the model built at any point - through the command line and
through ``load_model`` + ``accelerate``; speculation stays token-identical to plain decoding on them.
A drafter that drafts with the target's own model keeps the float target."""

import json

import pytest
import torch

import fastdecode
from fastdecode.args import EngineArgs
from fastdecode.cli import main
from fastdecode.data.suite import builtin_suite
from fastdecode.errors import ModelLoadError
from fastdecode.loaders.gguf_model import GGUFSource, GGUFTensor, is_lazy

FILE_BLOCKS = "gguf:q4_1+q8_0"  # every linear layer's Q4_1 blocks, the Q8_0 embedding as the LM head
DOCUMENT = next(s.prompt for s in builtin_suite() if s.category == "code")


@pytest.fixture
def no_float_copy(monkeypatch):
    """Fail the test where anything reads the file's weights as float (the whole model or one tensor)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a float copy of the model's weights was built")

    monkeypatch.setattr(GGUFSource, "materialize", refuse)
    monkeypatch.setattr(GGUFTensor, "float_weight", refuse)


def test_load_model_keeps_the_file_and_accelerate_runs_its_blocks(no_float_copy):
    model, tokenizer = fastdecode.load_model("smollm2-135m")
    assert is_lazy(model)
    with pytest.raises(ModelLoadError, match=r"lazy=False"):  # called as a transformers model: what to do
        model(torch.tensor([[1, 2, 3]]))
    plain = fastdecode.accelerate(model, tokenizer, drafter=None)
    assert plain.target.weights == FILE_BLOCKS
    expected = plain.generate(DOCUMENT, max_new_tokens=32)
    ngram = fastdecode.accelerate(model, tokenizer, drafter="ngram")
    result = ngram.generate(DOCUMENT, max_new_tokens=32)
    assert result.token_ids == expected.token_ids  # lossless against the target that runs
    assert result.acceptance.accepted_tokens > 0
    assert is_lazy(model)  # still in its file


def test_generate_runs_the_file_blocks_by_default(no_float_copy, capsys):
    outputs = {}
    for drafter in ("none", "ngram"):
        args = ["generate", "--prompt", DOCUMENT, "--max-new-tokens", "24", "--json", "--drafter", drafter]
        assert main(args) == 0
        outputs[drafter] = json.loads(capsys.readouterr().out)
    assert outputs["none"]["weights"] == outputs["ngram"]["weights"] == FILE_BLOCKS  # the resolved choice, named
    assert outputs["ngram"]["token_ids"] == outputs["none"]["token_ids"]


def test_a_drafter_over_the_target_keeps_the_float_model():
    """The model's own blocks drafting for it (README's exact float32 command): auto takes float for the target."""
    engine = EngineArgs(drafter="draft-model", draft_quant="gguf", draft_k=4).create_engine()
    assert engine.target.weights == "float"
    assert engine.drafter.executor.weights == FILE_BLOCKS
