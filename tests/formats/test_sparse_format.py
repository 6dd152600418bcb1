"""sparse24 and sparse24-f32 (fastdecode.formats.sparse): 2:4 sparse q8_0 / float32 on the native
decoder computes the dense q8_0 / float32 layers' bits over the same pruned weights, loads a
compressed directory, and speculation against it, or with it drafting, is token-identical to plain
decoding."""

import copy

import pytest
import torch
from speculation_checks import PROMPT, assert_speculation_is_lossless, plain_generation
from tiny_models import save_tiny_llama
from torch import nn

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.backends.base import PagedSequence
from fastdecode.cli import main
from fastdecode.errors import ConfigError
from fastdecode.formats import weight_format
from fastdecode.formats.float import FloatLinear, RowInvariantLinear
from fastdecode.formats.gguf import BlockLinear
from fastdecode.formats.sparse import Sparse24F32Linear, Sparse24Linear, SparseWeights, prune_2_4
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.loading import load_model
from fastdecode.quant.api import quantize_
from fastdecode.quant.pruning import PruneConfig
from fastdecode.quant.serialization import load_quantized, save_quantized

PROMPT_64 = [1, 40, 11, 9, 55, 23, 8, 14, 40, 11]  # for a model of 64 tokens
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


def _prompt_logits(model, weights, prompt=PROMPT):
    return PagedSequence(make_target(model, "native", weights)).forward(prompt, len(prompt))


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


# ---------------------------------------------------------------- sparse24-f32


def test_one_weight_runs_as_the_dense_float32_layer_of_its_pruned_values():
    linear = nn.Linear(100, 24)  # 100: a chunk of four at the end
    x = torch.randn(5, 100)
    layer = weight_format("sparse24-f32").native_linear(linear.weight, linear.bias, "auto")
    assert isinstance(layer, Sparse24F32Linear)
    dense = RowInvariantLinear(prune_2_4(linear.weight), linear.bias.detach())
    for m in (1, 3, 5):
        assert torch.equal(layer(x[:m]), dense(x[:m]))
    assert layer.weight_bytes() < 0.6 * dense.weight_bytes()  # 68 bytes a row's 32 weights for 128
    assert isinstance(weight_format("sparse24-f32").native_linear(linear.weight, None, "torch"), FloatLinear)
    with pytest.raises(ConfigError, match="multiple of 4"):
        weight_format("sparse24-f32").native_linear(torch.zeros(8, 30), None, "auto")


def test_a_pruned_model_runs_on_sparse24_f32_with_floats_bits(pruned_24):
    target = make_target(pruned_24, "native", "sparse24-f32")
    assert target.weights == "sparse24-f32+float"  # the decoder's projections sparse, the LM head dense
    assert target.kernel_note is None or "magnitude" not in target.kernel_note
    assert torch.equal(_prompt_logits(pruned_24, "sparse24-f32"), _prompt_logits(pruned_24, "float"))


def test_a_dense_model_is_pruned_by_magnitude_for_sparse24_f32_and_says_so(tiny_model):
    layers = SparseWeights(tiny_model, values="f32")
    mlp = tiny_model.model.layers[0].mlp
    layer = layers([mlp.gate_proj, mlp.up_proj], None)
    assert isinstance(layer, Sparse24F32Linear)
    assert layers.weights == "sparse24-f32" and "--weights sparse24-f32" in layers.note
    assert layers.adopt([mlp.down_proj], None) is None  # saved q8_0 modules are sparse24's


def test_a_directory_compressed_2_4_in_float_loads_onto_sparse24_f32(tmp_path, capsys):
    out = tmp_path / "m24"
    args = ["compress", str(save_tiny_llama(tmp_path / "tiny")), "--method", "magnitude", "--pattern", "2:4"]
    assert main([*args, "--out", str(out), "--eval-windows", "0"]) == 0
    assert "--weights sparse24-f32" in capsys.readouterr().out
    loaded, _ = load_model(str(out), dtype="float32")
    target = make_target(loaded, "native", "sparse24-f32")
    assert target.weights == "sparse24-f32+float"
    assert target.kernel_note is None or "magnitude" not in target.kernel_note  # already 2:4: nothing pruned
    assert torch.equal(_prompt_logits(loaded, "sparse24-f32", PROMPT_64), _prompt_logits(loaded, "float", PROMPT_64))


@pytest.fixture(scope="module")
def plain_sparse_f32(pruned_24, tokenizer):
    return Engine(pruned_24, tokenizer, target=make_target(pruned_24, "native", "sparse24-f32")).generate(
        PROMPT, max_new_tokens=40
    )


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_against_sparse24_f32_is_token_identical_to_plain(pruned_24, tokenizer, plain_sparse_f32, drafter):
    if drafter == "ngram":
        draft = build_drafter("ngram", n=3)
    else:
        draft = build_drafter("draft-model", model=pruned_24, k=3, weights="sparse24-f32")
    engine = Engine(pruned_24, tokenizer, drafter=draft, target=make_target(pruned_24, "native", "sparse24-f32"))
    result = engine.generate(PROMPT, max_new_tokens=40, draft_k=3)
    assert result.token_ids == plain_sparse_f32.token_ids
    assert result.acceptance.drafted_tokens > 0
    float_plain = Engine(pruned_24, tokenizer, target=make_target(pruned_24, "native", "float")).generate(
        PROMPT, max_new_tokens=40
    )
    assert result.token_ids == float_plain.token_ids  # the pruned float model's own tokens
