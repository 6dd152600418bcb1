"""The one builder of tiny random-weight Llamas the unit tests use (imported by name:
tests/ is on sys.path through its conftest)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
# Sizes torch's int8/int4 packed kernels accept (in_features % 32, out_features % 16).
KERNEL_FRIENDLY = dict(TINY, vocab_size=128, hidden_size=64, intermediate_size=128)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A float32 Llama in eval mode from ``TINY`` with ``overrides`` applied."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).to(torch.float32).eval()


def tiny_gemma3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A Gemma 3 text model from ``TINY``: local layers with a 5-position sliding window
    (so prompts of a dozen tokens cross it) around one global layer, and random norm
    weights (Gemma initialises them to 0, i.e. scale 1, which would hide the 1 + w offset)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = dict(
        TINY,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**config, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def word_tokenizer(words: str = "w", size: int = 61):
    """A fast word-level tokenizer: <unk> <s> </s> (ids 0, 1, 2), then ``words``0 ..
    ``words``{size - 1}, split on whitespace: a local model directory's tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *[f"{words}{i}" for i in range(size)]])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny_llama(path, tokenizer=None, seed: int = 0, **overrides):
    """Save a tiny random-weight Llama (``KERNEL_FRIENDLY`` with ``overrides``; bos 1, eos 2)
    and ``tokenizer`` (default: :func:`word_tokenizer` filling the vocabulary) as a model
    directory that ``--model DIR`` loads; returns ``path``."""
    config = {**KERNEL_FRIENDLY, "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path, safe_serialization=True)
    (tokenizer if tokenizer is not None else word_tokenizer(size=config["vocab_size"] - 3)).save_pretrained(path)
    return path
