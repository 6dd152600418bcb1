"""A tiny random-weight Llama saved as a local model directory, with a
character-level fast tokenizer, so the harness runs end to end through
``load_model`` in well under a second per generation."""

from __future__ import annotations

import pytest

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB_SIZE = 128


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n", *(chr(c) for c in range(32, 127))]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tiny_models import save_tiny_llama

    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"),
        char_tokenizer(),
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=2048,
        pad_token_id=0,
    )
