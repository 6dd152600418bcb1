"""A tiny random-weight Llama whose layer shapes fit torch's low-bit kernels
(in_features a multiple of 16 for int8 and of the group size for int4; hidden 64
and intermediate 128 admit group sizes 32, 64 and, for down_proj, 128)."""

import pytest
import torch

QUANT_VOCAB = 128


def build_quant_llama(seed: int = 0, tie_word_embeddings: bool = False):
    from tiny_models import KERNEL_FRIENDLY, tiny_llama

    return tiny_llama(seed, **dict(KERNEL_FRIENDLY, vocab_size=QUANT_VOCAB), tie_word_embeddings=tie_word_embeddings)


@pytest.fixture
def quant_llama():
    """A fresh model per test: quantize_ edits it in place."""
    return build_quant_llama()


@pytest.fixture(scope="session")
def build_llama():
    return build_quant_llama


@pytest.fixture(scope="session")
def probe_ids():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, QUANT_VOCAB, (2, 24), generator=generator)  # [batch, seq]


@pytest.fixture(scope="session")
def calibration_ids():
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, QUANT_VOCAB, (64,), generator=generator).tolist() for _ in range(4)]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="session")
def run_logits():
    return logits
