"""A model whose layers were saved low-bit (fastdecode quantize) names that numeric model on
both backends, whatever --weights says: the JSON output says what ran, and the transformers
backend refuses speculation on it as on any low-bit target."""

import copy

import pytest
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.errors import IncompatibleDrafterError
from fastdecode.quant import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
from fastdecode.quant.api import saved_precisions


@pytest.fixture(scope="module")
def float_model():
    return tiny_llama(4, **KERNEL_FRIENDLY)


def _quantized(model, config):
    model = copy.deepcopy(model)
    quantize_(model, config)  # the default skip: the LM head stays float
    return model


@pytest.mark.parametrize(
    "config,kind", [(Int8WeightOnlyConfig(), "int8"), (Int4WeightOnlyConfig(group_size=32), "int4")]
)
def test_saved_low_bit_layers_name_the_numeric_model(float_model, config, kind):
    model = _quantized(float_model, config)
    assert saved_precisions(model) == {kind: 14}  # q, k, v, o, gate, up, down in 2 layers; the LM head float
    assert make_target(model, "native").weights == f"{kind}+float"
    assert make_target(model, "hf").weights == f"{kind}+float"
    assert make_target(float_model, "hf").weights == "float"


def test_transformers_backend_refuses_speculation_on_a_saved_low_bit_model(float_model, tokenizer):
    model = _quantized(float_model, Int8WeightOnlyConfig())
    with pytest.raises(IncompatibleDrafterError, match="int8\\+float weights"):
        Engine(model, tokenizer, target=make_target(model, "hf"), drafter=build_drafter("ngram"))
    Engine(
        model, tokenizer, target=make_target(model, "native"), drafter=build_drafter("ngram")
    )  # row-invariant: allowed
