"""Each architecture written to GGUF (the project's exporter, llama.cpp's keys and tensor names) and loaded
by the file-size loader runs natively from the file: transformers' logits (float32 tensors), transformers'
greedy tokens, and n-gram speculation token-identical to plain decoding; no float model is built. Every
other native dense architecture (CASES): its config read back from llama.cpp's keys, the logits of the
same model loaded from its Hugging Face directory bit for bit, the same 32 greedy tokens, a q8_0 file
speculating as it decodes; a file missing a required key refused by name, and what llama.cpp's file
cannot say refused by the writer."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from tiny_models import tiny_gemma3, tiny_llama

import fastdecode
from fastdecode.backends import PagedSequence, make_target
from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.formats import gguf_export
from fastdecode.formats.gguf_export import export_gguf
from fastdecode.loaders.gguf_model import is_lazy
from fastdecode.loading import BUILTIN_MODELS, load_model

pytestmark = pytest.mark.integration  # the embedded model's tokenizer is copied into each file

VOCAB = 49152
TOKENIZER = BUILTIN_MODELS["smollm2-135m"].locate()
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
IDS = [1, 50, 700, 9000, 33, 48000, 5, 17, 4242, 12, 300, 7, 9, 11, 2048, 99]


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=128, num_hidden_layers=2, max_position_embeddings=256))


BUILDERS = {
    "llama": lambda: tiny_llama(1, **SMALL),
    "qwen3": _qwen3,
    # Gemma 3 as llama.cpp writes it: every sixth layer global, query scale 1/sqrt(head_dim) (GGUF keeps no
    # query_pre_attn_scalar: a file reads back as transformers' default, 256)
    "gemma3": lambda: tiny_gemma3(
        2, **SMALL, head_dim=256, query_pre_attn_scalar=256, layer_types=None, num_hidden_layers=6
    ),
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def exported(request, tmp_path_factory):
    model = BUILDERS[request.param]().eval()
    path = export_gguf(model, tmp_path_factory.mktemp(request.param) / "m.gguf", TOKENIZER, "f32")
    return model, path


def test_native_from_the_file_is_transformers(exported):
    model, path = exported
    lazy, tokenizer = load_model(str(path), lazy=True)
    target = make_target(lazy, "native", "gguf")
    assert is_lazy(lazy)  # the layers came from the file: no float model was built
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0]
    got = PagedSequence(target).forward(IDS, len(IDS))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    greedy = model.generate(torch.tensor([IDS]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(IDS, max_new_tokens=16).token_ids
    assert tokens == greedy[0, len(IDS) :].tolist()
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(IDS, max_new_tokens=16).token_ids == tokens


# ------------------------------------------------------- every other native dense architecture

# model_type -> its config beyond DENSE: what makes each exercise the keys llama.cpp writes for it
_LONGROPE = dict(  # Phi-3.5's RoPE: short factors up to the original length, long ones past it
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=[1.0 + 0.05 * i for i in range(8)],
    long_factor=[2.0 + 0.1 * i for i in range(8)],
)
DENSE = dict(
    SMALL, head_dim=16, num_hidden_layers=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0
)
CASES = {
    "mistral": ("mistral", dict(sliding_window=None)),  # written as a "llama"
    "qwen3": ("qwen3", {}),  # head_dim 16 from attention.key_length (transformers' table: the default, 128)
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "exaone4": (
        "exaone4",
        dict(
            num_hidden_layers=3,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
        ),
    ),
    "granite": (  # every multiplier read back from its *_scale key
        "granite",
        dict(
            embedding_multiplier=6.0,
            attention_multiplier=0.09,
            residual_multiplier=0.3,
            logits_scaling=4.0,
        ),
    ),
    "smollm3": ("smollm3", dict(num_hidden_layers=4)),  # NoPE in layer 3: llama.cpp's every fourth
    "phi3": ("phi3", dict(sliding_window=12)),  # fused attn_qkv and ffn_up, a window
    "phi3-longrope": (
        "phi3",
        dict(rope_parameters=_LONGROPE, original_max_position_embeddings=96, max_position_embeddings=192),
    ),
    "gemma2": (  # soft caps that bite on a tiny model; llama.cpp's query scale 1/sqrt(head_dim)
        "gemma2",
        dict(
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=0.05,
            final_logit_softcapping=0.3,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
        ),
    ),
}
# what each case's config must read back from the file (beyond the common keys every case compares)
READ_BACK = {
    "qwen3": ("head_dim",),
    "olmo3": ("sliding_window", "layer_types"),
    "exaone4": ("sliding_window", "layer_types", "head_dim"),
    "granite": ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"),
    "smollm3": ("no_rope_layers",),
    "phi3": ("sliding_window",),
    "phi3-longrope": ("original_max_position_embeddings",),
    "gemma2": ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "layer_types"),
}
COMMON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
PROMPT = IDS * 2  # 32 tokens
NEW = dict(max_new_tokens=32, min_tokens=32)  # EOS masked: 32 tokens every time


def _dense(name: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = CASES[name]
    torch.manual_seed(5)
    config = AutoConfig.for_model(model_type, **{**DENSE, **fields, **overrides})
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if model_type == "gemma2":  # Gemma initialises its norms to 0 (scale 1): random ones show the 1 + w offset
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "norm" in param_name:
                    p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def dense(request, tmp_path_factory):
    """(case, transformers model, its GGUF, its Hugging Face directory with the GGUF's tokenizer)."""
    model = _dense(request.param)
    tmp = tmp_path_factory.mktemp(request.param)
    path = export_gguf(model, tmp / "m.gguf", TOKENIZER, "f32")
    model.save_pretrained(tmp / "hf")
    load_model(str(path), lazy=True)[1].save_pretrained(tmp / "hf")
    return request.param, model, path, tmp / "hf"


def test_the_config_is_read_from_llama_cpp_s_keys(dense):
    name, model, path, _ = dense
    lazy, _ = load_model(str(path), lazy=True)
    expected_type = (
        "llama" if name == "mistral" else model.config.model_type
    )  # llama.cpp's "llama", as transformers reads it
    assert lazy.config.model_type == expected_type
    for key in (*COMMON, *READ_BACK.get(name, ())):
        expected = getattr(model.config, key)
        if isinstance(expected, float):  # a GGUF keeps float32
            expected = float(np.float32(expected))
        assert getattr(lazy.config, key) == expected, key
    if name == "phi3-longrope":
        rope = lazy.config.rope_parameters
        assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 96
        torch.testing.assert_close(torch.tensor(rope["long_factor"]), torch.tensor(_LONGROPE["long_factor"]))
        torch.testing.assert_close(torch.tensor(rope["short_factor"]), torch.tensor(_LONGROPE["short_factor"]))


def test_native_from_the_file_is_native_from_the_directory(dense):
    name, model, path, directory = dense
    lazy, tokenizer = load_model(str(path), lazy=True)
    from_dir, _ = load_model(str(directory))
    gguf_target = make_target(lazy, "native", "gguf")
    assert is_lazy(lazy)  # the layers came from the file: no float model was built
    got = PagedSequence(gguf_target).forward(PROMPT, len(PROMPT))
    expected = PagedSequence(make_target(from_dir, "native", "float")).forward(PROMPT, len(PROMPT))
    assert torch.equal(got, expected)
    with torch.no_grad():
        hf = model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, hf, rtol=1e-4, atol=1e-4)

    tokens = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf").generate(PROMPT, **NEW).token_ids
    plain_dir = fastdecode.accelerate(from_dir, tokenizer, drafter=None, weights="float")
    assert len(tokens) == 32 and plain_dir.generate(PROMPT, **NEW).token_ids == tokens


@pytest.mark.parametrize("name", ["olmo2", "exaone4", "granite", "smollm3", "phi3", "gemma2"])
def test_a_q8_0_file_speculates_as_it_decodes(name, tmp_path):
    path = export_gguf(_dense(name), tmp_path / "m.gguf", TOKENIZER, "q8_0")
    lazy, tokenizer = load_model(str(path), lazy=True)
    assert make_target(lazy, "native", "gguf").weights == "gguf:q8_0"
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate(PROMPT, **NEW).token_ids
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate(PROMPT, **NEW).token_ids == tokens


@pytest.mark.parametrize(
    "name, writer_method, key",
    [
        ("olmo2", "add_embedding_length", "olmo2.embedding_length"),  # our own table
        ("granite", "add_block_count", "granite.block_count"),
        ("exaone4", "add_layer_norm_rms_eps", "exaone4.attention.layer_norm_rms_epsilon"),
        ("phi3", "add_head_count", "phi3.attention.head_count"),  # transformers' table
    ],
)
def test_a_file_without_a_required_key_is_refused_by_name(name, writer_method, key, tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, writer_method, lambda self, value: None)
    path = export_gguf(_dense(name), tmp_path / "m.gguf", TOKENIZER, "f32")
    with pytest.raises(ModelLoadError, match=rf"m\.gguf: the GGUF metadata lacks {re.escape(key)}, which"):
        load_model(str(path), lazy=True)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("smollm3", dict(no_rope_layer_interval=3), "NoPE in every fourth layer"),
        ("gemma2", dict(query_pre_attn_scalar=32), r"scales queries by 1/sqrt\(16\)"),
        ("granite", dict(head_dim=8), "head_dim = hidden / heads = 16"),
        ("mistral", dict(sliding_window=64), "no sliding window"),
    ],
)
def test_what_llama_cpp_s_file_cannot_say_is_not_written(name, overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        export_gguf(_dense(name, **overrides), tmp_path / "m.gguf", TOKENIZER, "f32")


_LLAMA3 = dict(
    rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


def test_llama_3_s_rope_is_read_from_rope_freqs(tmp_path, monkeypatch):
    # its only trace in a GGUF is the rope_freqs tensor (transformers' loader ignores it: the default RoPE)
    rope = dict(_LLAMA3, rope_theta=500000.0)
    small = dict(SMALL, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = tiny_llama(1, **small, rope_parameters=rope)
    lazy, _ = load_model(str(export_gguf(model, tmp_path / "m.gguf", TOKENIZER, "f32")), lazy=True)
    assert lazy.config.rope_parameters == rope
    got = PagedSequence(make_target(lazy, "native", "gguf")).forward(PROMPT, len(PROMPT))
    with torch.no_grad():
        torch.testing.assert_close(got, model(torch.tensor([PROMPT])).logits[0], rtol=1e-4, atol=1e-4)

    monkeypatch.setattr(gguf_export, "llama3_rope_factors", lambda shape: np.linspace(1.0, 3.0, 32, dtype=np.float32))
    path = export_gguf(model, tmp_path / "other.gguf", TOKENIZER, "f32")
    with pytest.raises(ModelLoadError, match="rope_freqs.weight holds factors that are not Llama 3's"):
        load_model(str(path), lazy=True)


_GEMMA3_LINEAR = {  # Gemma 3's global layers scaled (4B and up), its local ones not
    "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
    "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
}
_GEMMA3 = dict(SMALL, head_dim=256, query_pre_attn_scalar=256, layer_types=None, num_hidden_layers=6)
LINEAR = {
    "llama": lambda: tiny_llama(1, **SMALL, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e4)),
    "gemma3": lambda: tiny_gemma3(2, **_GEMMA3, rope_parameters=_GEMMA3_LINEAR),
}


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_linear_rope_scaling_is_read(name, tmp_path):
    model = LINEAR[name]()
    lazy, _ = load_model(str(export_gguf(model, tmp_path / "m.gguf", TOKENIZER, "f32")), lazy=True)
    assert lazy.config.rope_parameters == model.config.rope_parameters
    got = PagedSequence(make_target(lazy, "native", "gguf")).forward(PROMPT, len(PROMPT))
    with torch.no_grad():
        torch.testing.assert_close(got, model(torch.tensor([PROMPT])).logits[0], rtol=1e-4, atol=1e-4)


def test_a_rope_scaling_not_read_is_refused(tmp_path, monkeypatch):
    import gguf

    write = gguf.GGUFWriter.add_rope_scaling_type
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_rope_scaling_type", lambda self, v: write(self, gguf.RopeScalingType.YARN)
    )
    path = export_gguf(LINEAR["llama"](), tmp_path / "m.gguf", TOKENIZER, "f32")
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.scaling\.type 'yarn' \(factor 4\.0\) is not read here"):
        load_model(str(path), lazy=True)
