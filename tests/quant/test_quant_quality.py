"""Perplexity: the quality measure reported for quantized models."""

import math

import pytest
import torch
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode.quant.api import Int4WeightOnlyConfig, quantize_
from fastdecode.quant.quality import perplexity


class Tok:
    def __call__(self, text):
        return {"input_ids": [3 + (ord(c) % 120) for c in text]}


def test_perplexity_is_that_of_the_model_and_moves_with_quantization():
    model = tiny_llama(0, **KERNEL_FRIENDLY)
    text = "the quick brown fox jumps over the lazy dog " * 4
    ppl = perplexity(model, Tok(), text)
    ids = torch.tensor([Tok()(text)["input_ids"]])
    with torch.no_grad():
        expected = math.exp(float(model(ids, labels=ids).loss))
    assert ppl == pytest.approx(expected, rel=1e-4)
    quantize_(model, Int4WeightOnlyConfig(group_size=32), skip=())
    assert perplexity(model, Tok(), text) != ppl
    with pytest.raises(ValueError):
        perplexity(model, Tok(), "a")
