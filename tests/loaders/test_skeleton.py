"""The native skeleton (``loaders/skeleton.py``) against transformers' skeleton: the same parameter names
and shapes and the same RoPE tables (bit for bit) for every architecture with a config view; loaded from a
GGUF file, the same config fields, the same tensors hung where transformers' skeleton has them; turned
into transformers' model where float weights are asked for; and a native load that imports none of
transformers' model or config classes (a fresh process's ``sys.modules``)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf_files import write_tokenizer_gguf

from fastdecode.architectures import ARCHITECTURES, Unsupported
from fastdecode.architectures.config_view import DECODER_FIELDS, DEFAULTS, config_view
from fastdecode.backends import PagedSequence, make_target
from fastdecode.engine.output import eos_ids
from fastdecode.errors import ModelLoadError
from fastdecode.formats.gguf_export import export_gguf
from fastdecode.kernels.build import cache_root
from fastdecode.loaders.gguf_config import config_from_dict, gguf_config_dict
from fastdecode.loaders.gguf_model import ATTR, EXPERTS_ATTR, _SmallTensors, is_lazy, load_gguf, materialize
from fastdecode.loaders.skeleton import SkeletonCausalLM
from fastdecode.loading import load_model

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=256,
    pad_token_id=0,  # within the vocabulary (transformers' embedding refuses a padding id past it)
)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
EXTRA = {  # beyond SMALL, per model_type: what its layers need to be small and of every kind
    "gemma3_text": dict(
        num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=16
    ),  # llama.cpp: head_dim
    "gemma2": dict(head_dim=16, sliding_window=8),
    "exaone4": dict(num_hidden_layers=4, sliding_window=8),
    "qwen3": dict(head_dim=128),  # what a GGUF file of it reads back as (transformers maps no head_dim for it)
    "qwen3_moe": dict(_MOE, norm_topk_prob=True, head_dim=16),
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "smollm3": dict(num_hidden_layers=4),
    "granite": dict(attention_bias=True, mlp_bias=True),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8),
}
_NO_EOS = SimpleNamespace(eos_token_id=None)  # a tokenizer that names no stop id
# the GGUF tests' types
EXPORTED = ("llama", "qwen3", "gemma3_text", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")


def _fields(model_type: str, **overrides) -> dict:
    return dict(SMALL, model_type=model_type, **EXTRA.get(model_type, {}), **overrides)


def _transformers_skeleton(fields: dict):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float32).eval()


def _rope_keys(model) -> set:
    config = model.config
    try:
        arch = ARCHITECTURES[config.model_type].describe(config)
    except Unsupported:
        return {None}
    return {arch.rope_key(i) for i in range(config.num_hidden_layers)} - {"nope"}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_the_skeleton_is_transformers(model_type, tied):
    fields = _fields(model_type, tie_word_embeddings=tied)
    theirs = _transformers_skeleton(fields)
    view = config_view(fields)
    ours = SkeletonCausalLM(view, ARCHITECTURES[model_type].describe(view))
    shapes = [{n: tuple(p.shape) for n, p in m.named_parameters(remove_duplicate=False)} for m in (ours, theirs)]
    assert shapes[0] == shapes[1]
    assert all(p.device.type == "meta" for p in ours.parameters())
    positions = torch.arange(300)[None]
    probe = torch.empty(1)
    for key in _rope_keys(theirs):
        args = () if key is None else (key,)
        for got, expected in zip(
            ours.model.rotary_emb(probe, positions, *args), theirs.model.rotary_emb(probe, positions, *args)
        ):
            assert torch.equal(got, expected), key


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tokenizer") / "tokenizer.gguf", VOCAB)


def _model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = _fields(model_type)
    fields.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # not the initial ones and zeros: the norms are read from the file
                p.normal_(0.5, 0.3)
    return model


@pytest.fixture(scope="module", params=EXPORTED)
def exported(request, tmp_path_factory, tokenizer_gguf):
    model = _model(request.param)
    return model, export_gguf(model, tmp_path_factory.mktemp(request.param) / "m.gguf", tokenizer_gguf, "q8_0")


def _placed(model) -> dict:
    """Every tensor hung on ``model``'s modules: module name -> (GGUF tensor, row order) or the experts'."""
    out = {}
    for name, module in model.named_modules():
        ref = getattr(module, ATTR, None)
        if ref is not None:
            out[name] = (ref.name, None if ref.row_order is None else ref.row_order.tolist())
        experts = getattr(module, EXPERTS_ATTR, None)
        if experts is not None:
            out[name] = [[(r.name, r.span) for r in part] for part in experts]
    return out


def test_a_file_loads_as_transformers_skeleton_does(exported):
    _, path = exported
    ours, theirs = load_gguf(str(path)), load_gguf(str(path), native=False)
    assert isinstance(ours, SkeletonCausalLM) and not isinstance(theirs, SkeletonCausalLM)
    config = config_from_dict(ours.fastdecode_lazy.file, gguf_config_dict(ours.fastdecode_lazy.file))
    assert {f: getattr(ours.config, f, None) for f in DECODER_FIELDS} == {
        f: getattr(config, f, None) for f in DECODER_FIELDS
    }
    assert _placed(ours) == _placed(theirs)
    real = [{n: p for n, p in m.named_parameters() if p.device.type != "meta"} for m in (ours, theirs)]
    assert real[0].keys() == real[1].keys()
    assert all(torch.equal(real[0][n], real[1][n]) for n in real[0])  # the norms, as transformers reads them
    assert eos_ids(ours, _NO_EOS) == eos_ids(theirs, _NO_EOS)  # the config's (and generation config's) stop ids
    ids = [1, 50, 70, 9, 33, 12, 5, 17, 99, 3]
    got, expected = (PagedSequence(make_target(m, "native", "gguf")).forward(ids, len(ids)) for m in (ours, theirs))
    assert torch.equal(got, expected)  # the same model, bit for bit


def test_float_weights_make_it_transformers_model_in_place(exported):
    model, path = exported
    lazy, _ = load_model(str(path))
    assert isinstance(lazy, SkeletonCausalLM)
    for call in (lazy, lazy.generate):  # as a transformers model: what to do instead
        with pytest.raises(ModelLoadError, match=r"lazy=False"):
            call(torch.tensor([[1, 2, 3]]))
    make_target(lazy, "native", "gguf")  # a target on its blocks first: the skeleton is still whole after it
    same = lazy
    assert materialize(lazy) is same and not is_lazy(lazy)
    assert type(lazy) is type(model)  # the object the caller holds is transformers' model now
    full, _ = load_model(str(path), lazy=False)
    assert {n: p for n, p in lazy.named_parameters()}.keys() == {n: p for n, p in full.named_parameters()}.keys()
    assert all(torch.equal(p, full.get_parameter(n)) for n, p in lazy.named_parameters())
    ids = torch.tensor([[1, 50, 70, 9, 33, 12, 5, 17]])
    with torch.no_grad():
        assert torch.equal(lazy(ids).logits, full(ids).logits)


def test_hf_and_float_targets_of_a_native_skeleton(exported):
    model, path = exported
    ids = [1, 50, 70, 9, 33, 12]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    for backend, weights in (("hf", "auto"), ("native", "float")):
        lazy, _ = load_model(str(path))
        got = PagedSequence(make_target(lazy, backend, weights)).forward(ids, len(ids))
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # q8_0 weights against float32 ones


_CHILD = """
import json, sys
from fastdecode.args import EngineArgs
engine = EngineArgs(model=sys.argv[1], drafter="ngram").create_engine()
engine.generate([1, 50, 70, 9], max_new_tokens=4)
prefixes = ("transformers.modeling_utils", "transformers.models.auto", "transformers.activations", "torch.distributed.tensor")
heavy = [m for m in sys.modules if m.startswith(prefixes)
         or (m.startswith("transformers.models.") and (".modeling_" in m or ".configuration_" in m))]
index = "transformers.models" in sys.modules  # transformers' index of every model (its package's __init__)
print(json.dumps({"target": type(engine.target).__name__, "weights": engine.target.weights, "heavy": sorted(heavy),
                  "index": index}))
"""


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_moe", "gpt_oss"])
def test_a_native_load_imports_no_transformers_model(model_type, tmp_path, tokenizer_gguf, child_process_env):
    path = export_gguf(_model(model_type), tmp_path / "m.gguf", tokenizer_gguf, "q8_0")
    # A cache of its own (the built kernels shared): its tokenizer is keyed by content, and every file
    # written with `tokenizer_gguf` has the same one, so the default cache may hold it already.
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    env = dict(child_process_env, FASTDECODE_CACHE=str(tmp_path / "cache"))
    for run_ in (
        "built",
        "cached",
    ):  # the tokenizer built from the file (a new cache: a new entry), then read back
        run = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        found = json.loads(run.stdout.strip().splitlines()[-1])
        assert found["target"] == "NativeTarget" and found["weights"] == "gguf:q8_0"
        assert found["heavy"] == []
        assert found["index"] == (run_ == "built")  # only transformers' GGUF tokenizer conversion reads the index


@pytest.mark.parametrize(
    "arch, name, n",
    [
        ("llama", "blk.0.attn_q.bias", 64),
        ("llama", "blk.0.attn_k.bias", 32),
        ("llama", "blk.0.attn_norm.weight", 64),
        ("gemma3", "blk.0.attn_q_norm.weight", 16),
        ("gemma2", "output_norm.weight", 64),
        ("qwen3moe", "blk.1.ffn_norm.weight", 64),
    ],
)
def test_the_small_tensors_are_read_as_transformers_processors_read_them(arch, name, n):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = dict(num_attention_heads=4, num_key_value_heads=2)
    values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    theirs = processor.process(weights=values, name=name, tensor_key_mapping={}).weights
    ours = _SmallTensors(SimpleNamespace(architecture=arch), config).process(values, name).weights
    assert np.array_equal(ours, theirs)
