"""A safetensors directory as a skeleton: the block formats quantize it layer by layer from the shards,
giving the very layers a float model gives; materialized, it is the model transformers loads."""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_llama

from fastdecode.backends import make_target
from fastdecode.loaders.gguf_model import is_lazy, materialize
from fastdecode.loading import load_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_lazy_directory_is_a_skeleton(model_dir):
    model, _ = load_model(str(model_dir), lazy=True)
    assert is_lazy(model)
    assert model.model.layers[0].mlp.down_proj.weight.device.type == "meta"


def test_materialized_is_transformers_own(model_dir):
    lazy, _ = load_model(str(model_dir), lazy=True)
    eager, _ = load_model(str(model_dir))
    assert not is_lazy(eager)
    materialize(lazy)
    ours, theirs = dict(lazy.named_parameters()), dict(eager.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "int8"])
def test_streamed_layers_equal_the_float_models(model_dir, weights):
    lazy, _ = load_model(str(model_dir), lazy=True)
    eager, _ = load_model(str(model_dir))
    streamed, reference = make_target(lazy, "native", weights), make_target(eager, "native", weights)
    assert streamed.weights == reference.weights
    assert is_lazy(lazy) == (weights != "int8")  # int8 is built from the materialized model
    x = torch.randn(5, eager.config.hidden_size)
    for a, b in zip(streamed.layers, reference.layers):
        assert torch.equal(a.qkv(x), b.qkv(x)) and torch.equal(a.gate_up(x), b.gate_up(x))
    assert torch.equal(streamed.lm_head(x), reference.lm_head(x))
    ids = torch.tensor([3, 5, 7])
    assert torch.equal(streamed.embed[ids], reference.embed[ids])


def test_auto_weights_run_a_directory_as_float_and_a_skeleton_refuses_a_direct_call(model_dir):
    from fastdecode.errors import ModelLoadError

    eager, _ = load_model(str(model_dir))  # the default: a directory's float model
    assert not is_lazy(eager)
    assert make_target(eager).weights == "float"  # weights="auto": a float model runs as float
    lazy, _ = load_model(str(model_dir), lazy=True)
    with pytest.raises(ModelLoadError, match=r"still in .*load_model\(\.\.\., lazy=False\)"):
        lazy(torch.tensor([[1, 2, 3]]))  # torch's error about the meta device would not say what to do
    assert make_target(lazy).weights == "float"  # no GGUF file: auto is float, read from the shards
    assert not is_lazy(lazy)
    with torch.no_grad():  # materialized, it is an ordinary transformers model again
        assert torch.equal(lazy(torch.tensor([[1, 2, 3]])).logits, eager(torch.tensor([[1, 2, 3]])).logits)
