"""sparse24 (fastdecode.formats.sparse): 2:4 sparse q8_0 on the native decoder computes the dense
q8_0 layers' bits over the same pruned weights, loads a compressed directory, and speculation
against it, or with it drafting, is token-identical to plain decoding."""

import copy

import pytest
import torch
from speculation_checks import PROMPT, assert_speculation_is_lossless, plain_generation
from torch import nn

from fastdecode.backends import make_target
from fastdecode.backends.base import PagedSequence
from fastdecode.errors import ConfigError
from fastdecode.formats import weight_format
from fastdecode.formats.gguf import BlockLinear
from fastdecode.formats.sparse import Sparse24Linear, SparseWeights, prune_2_4
from fastdecode.gguf_blocks import BlockTensor
from fastdecode.quant.api import quantize_
from fastdecode.quant.pruning import PruneConfig
from fastdecode.quant.serialization import load_quantized, save_quantized

CALIBRATION = tuple(tuple(range(3 + s, 67 + s)) for s in range(3))


@pytest.mark.parametrize("float_kernel", ["auto", "torch"])
def test_one_weight_runs_as_the_dense_q8_0_layer_of_its_pruned_values(float_kernel):
    linear = nn.Linear(64, 24)
    x = torch.randn(5, 64)
    layer = weight_format("sparse24").native_linear(linear.weight, linear.bias, float_kernel)
    assert isinstance(layer, Sparse24Linear)
    pruned = prune_2_4(linear.weight)
    assert ((pruned != 0).view(24, -1, 4).sum(-1) == 2).all()
    dense = BlockLinear([BlockTensor.quantize(pruned, "q8_0")], linear.bias, "torch")
    assert torch.equal(layer(x), dense(x))
    with pytest.raises(ConfigError, match="multiple of 4"):
        weight_format("sparse24").native_linear(torch.zeros(8, 30), None, float_kernel)
    assert layer.weight_bytes() < 0.7 * dense.weight_bytes()  # 22 bytes a block of a row for 34


@pytest.fixture(scope="module")
def pruned_24(tiny_model):
    """The tiny model pruned 2:4 by SparseGPT, float weights."""
    model = copy.deepcopy(tiny_model)
    quantize_(model, PruneConfig("sparsegpt", pattern=(2, 4), calibration_token_ids=CALIBRATION))
    return model


def _prompt_logits(model, weights):
    return PagedSequence(make_target(model, "native", weights)).forward(PROMPT, len(PROMPT))


def test_a_pruned_model_runs_on_sparse24_with_q8_0s_bits(pruned_24):
    target = make_target(pruned_24, "native", "sparse24")
    assert target.weights == "sparse24+q8_0"  # 14 decoder projections sparse, the LM head dense q8_0
    assert target.kernel_note is None or "magnitude" not in target.kernel_note
    assert torch.equal(_prompt_logits(pruned_24, "sparse24"), _prompt_logits(pruned_24, "q8_0"))


def test_a_dense_model_is_pruned_by_magnitude_and_says_so(tiny_model):
    layers = SparseWeights(tiny_model)
    attn = tiny_model.model.layers[0].self_attn
    layers([attn.q_proj, attn.k_proj, attn.v_proj], None)
    assert layers.weights == "sparse24" and "pruned by magnitude" in layers.note
    assert bool((attn.q_proj.weight != 0).all())  # the model itself is not changed


def test_a_directory_saved_2_4_then_q8_0_loads_onto_sparse24(tiny_model, tmp_path):
    model = copy.deepcopy(tiny_model)
    config = PruneConfig("wanda", pattern=(2, 4), then=weight_format("q8_0").quant_config(),
                         calibration_token_ids=CALIBRATION)  # fmt: skip
    quantize_(model, config)
    save_quantized(model, None, tmp_path, config)
    loaded, _ = load_quantized(tmp_path)
    sparse = make_target(loaded, "native", "sparse24")
    assert sparse.weights == "sparse24+q8_0"  # the saved q8_0 projections taken onto the sparse kernel
    assert make_target(loaded, "native", "q8_0").weights == "q8_0"
    assert torch.equal(_prompt_logits(loaded, "sparse24"), _prompt_logits(loaded, "q8_0"))


@pytest.fixture(scope="module")
def plain_sparse(pruned_24, tokenizer):
    return plain_generation(pruned_24, tokenizer, "sparse24")


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_against_sparse24_is_token_identical_to_plain(pruned_24, tokenizer, plain_sparse, drafter):
    assert_speculation_is_lossless(pruned_24, tokenizer, "sparse24", plain_sparse, drafter)
