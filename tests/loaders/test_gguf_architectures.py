"""Each architecture written to GGUF (the project's exporter) and loaded by the file-size loader runs
natively from the file: transformers' logits (float32 tensors), transformers' greedy tokens, and
n-gram speculation token-identical to plain decoding; no float model is built."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_gemma3, tiny_llama

import fastdecode
from fastdecode.backends import PagedSequence, make_target
from fastdecode.formats.gguf_export import export_gguf
from fastdecode.loaders.gguf_model import is_lazy
from fastdecode.loading import BUILTIN_MODELS, load_model

pytestmark = pytest.mark.integration  # the embedded model's tokenizer is copied into each file

VOCAB = 49152
TOKENIZER = BUILTIN_MODELS["smollm2-135m"].locate()
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
IDS = [1, 50, 700, 9000, 33, 48000, 5, 17, 4242, 12, 300, 7, 9, 11, 2048, 99]


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=128, num_hidden_layers=2, max_position_embeddings=256))


BUILDERS = {
    "llama": lambda: tiny_llama(1, **SMALL),
    "qwen3": _qwen3,
    # Gemma 3 as llama.cpp writes it: every sixth layer global, query scale 1/sqrt(head_dim) (GGUF keeps no
    # query_pre_attn_scalar: a file reads back as transformers' default, 256)
    "gemma3": lambda: tiny_gemma3(
        2, **SMALL, head_dim=256, query_pre_attn_scalar=256, layer_types=None, num_hidden_layers=6
    ),
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def exported(request, tmp_path_factory):
    model = BUILDERS[request.param]().eval()
    path = export_gguf(model, tmp_path_factory.mktemp(request.param) / "m.gguf", TOKENIZER, "f32")
    return model, path


def test_native_from_the_file_is_transformers(exported):
    model, path = exported
    lazy, tokenizer = load_model(str(path), lazy=True)
    target = make_target(lazy, "native", "gguf")
    assert is_lazy(lazy)  # the layers came from the file: no float model was built
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0]
    got = PagedSequence(target).forward(IDS, len(IDS))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    greedy = model.generate(torch.tensor([IDS]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(IDS, max_new_tokens=16).token_ids
    assert tokens == greedy[0, len(IDS) :].tolist()
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(IDS, max_new_tokens=16).token_ids == tokens
