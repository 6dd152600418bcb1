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


# -- a mixture of experts: per-expert tensors in the checkpoint, 3-D experts in the model


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe_dir(request, tmp_path_factory):
    from tiny_models import word_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    experts = dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if request.param == "mixtral":
        experts = dict(num_local_experts=4, intermediate_size=32)
    config = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config |= dict(num_key_value_heads=2, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, **experts)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param) / "model"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(request.param, **config)).save_pretrained(path)
    word_tokenizer(size=61).save_pretrained(path)
    return request.param, path


def test_experts_stream_from_the_shards(moe_dir):
    """Qwen's per-expert tensors are read expert by expert into the block formats (the skeleton stays
    lazy); Mixtral's checkpoint names (block_sparse_moe.experts.N.w1) are not the model's, so transformers
    loads it. Either way the native decoder gives the eagerly loaded model's bits."""
    from fastdecode.backends import PagedSequence

    name, path = moe_dir
    lazy, _ = load_model(str(path), lazy=True)
    eager, _ = load_model(str(path))
    assert is_lazy(lazy) == (name != "mixtral")
    if name != "mixtral":
        assert lazy.model.layers[0].mlp.experts.gate_up_proj.device.type == "meta"
    ids = [1, 5, 9, 12, 30, 31, 7, 2, 40]
    for weights in ("q8_0", "float"):  # float materializes the skeleton: transformers' own values
        streamed, reference = make_target(lazy, "native", weights), make_target(eager, "native", weights)
        assert torch.equal(PagedSequence(streamed).forward(ids, 9), PagedSequence(reference).forward(ids, 9))
    materialize(lazy)
    assert all(torch.equal(p, eager.get_parameter(n)) for n, p in lazy.named_parameters())


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


def test_gpt_oss_from_its_directory_is_transformers(tmp_path):
    """gpt-oss saved by save_pretrained: its experts 3-D in the checkpoint ([E, hidden, 2 I], gate and up
    interleaved) with biases [E, rows], read whole; sinks and the router's bias. The native decoder from the
    directory gives transformers' logits; the skeleton's weights stream into q8_0 as the eager model's do."""
    from tiny_models import word_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastdecode.backends import HFTarget, PagedSequence

    config = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    config |= dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    config |= dict(bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **config)).eval()
    with torch.no_grad():  # transformers' initialisation leaves the experts' biases zero, the sinks near it
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.copy_(torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    word_tokenizer(size=61).save_pretrained(tmp_path)
    lazy, _ = load_model(str(tmp_path), lazy=True)
    eager, _ = load_model(str(tmp_path))
    assert is_lazy(lazy) and lazy.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    ids = [1, 5, 9, 12, 30, 31, 7, 2, 40, 41, 42]  # past the window
    expected = HFTarget(model).forward(ids, len(ids))
    assert (PagedSequence(make_target(eager, "native", "float")).forward(ids, 11) - expected).abs().max() < 1e-4
    streamed, reference = make_target(lazy, "native", "q8_0"), make_target(eager, "native", "q8_0")
    assert torch.equal(PagedSequence(streamed).forward(ids, 11), PagedSequence(reference).forward(ids, 11))
    materialize(lazy)
    assert all(torch.equal(p, eager.get_parameter(n)) for n, p in lazy.named_parameters())
