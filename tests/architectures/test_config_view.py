"""The config view (``architectures/config_view.py``) against transformers' config class of each
model_type it knows: every field the native decoder reads, equal, for configs as a GGUF file's metadata
gives them (the defaults and the fields transformers derives from the others included)."""

from __future__ import annotations

import pytest

from fastdecode.architectures import ARCHITECTURES, Unsupported
from fastdecode.architectures.config_view import DECODER_FIELDS, DEFAULTS, ConfigView, config_view

BASE = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128)
VARIANTS = {  # what a file's metadata may say beyond BASE
    "defaults": {},
    "sized": dict(
        num_key_value_heads=2,
        rope_theta=500000.0,
        max_position_embeddings=256,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
    "head_dim": dict(head_dim=32, sliding_window=128, rms_norm_eps=1e-5, num_key_value_heads=1),
    "windowed": dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),
    "experts": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "local_experts": dict(num_local_experts=4, num_experts_per_tok=2),
    "named": dict(_model_name_or_path="tiny", eos_token_id=7, bos_token_id=5),
}


def test_the_native_architectures_have_views():
    # a native type without one loads through transformers' skeleton, as before (a DEFAULTS entry and its
    # derived fields give it the light path; this test then compares them)
    assert set(ARCHITECTURES) == set(DEFAULTS)
    assert set(DEFAULTS) <= set(ARCHITECTURES)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_the_view_is_transformers_config(model_type, variant):
    from transformers import AutoConfig

    fields = dict(BASE, model_type=model_type, **VARIANTS[variant])
    theirs = AutoConfig.for_model(**fields)
    ours = config_view(fields)
    assert isinstance(ours, ConfigView)
    differ = {f: (getattr(ours, f, None), getattr(theirs, f, None)) for f in DECODER_FIELDS}
    assert {f: v for f, v in differ.items() if v[0] != v[1]} == {}
    assert _described(ours) == _described(theirs)  # the same DecoderArch, or the same refusal


def _described(config):
    try:
        return ARCHITECTURES[config.model_type].describe(config)
    except Unsupported as exc:
        return str(exc)


def test_a_type_without_defaults_has_no_view():
    assert config_view(dict(BASE, model_type="gpt2")) is None


BAD = [
    dict(num_hidden_layers=2.5),
    dict(num_attention_heads="4"),
    dict(hidden_size=66),  # not a multiple of the heads
    dict(rms_norm_eps=1),  # an int where a float is declared
    dict(max_position_embeddings=2048.0),
    dict(tie_word_embeddings=0),
]


@pytest.mark.parametrize("bad", BAD)
def test_what_transformers_refuses_the_view_refuses(bad):
    from transformers import AutoConfig

    fields = dict(BASE, model_type="llama", **bad)
    with pytest.raises(Exception):  # noqa: B017 (ValueError, or huggingface_hub's strict-dataclass error)
        AutoConfig.for_model(**fields)
    with pytest.raises(ValueError):
        config_view(fields)


GPT_OSS_FILE = dict(  # what loaders/gguf_config.py gives for a gpt-oss file: YaRN with its base, the clamp's limit
    model_type="gpt_oss",
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    vocab_size=1000,
    max_position_embeddings=512,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        original_max_position_embeddings=128,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)


@pytest.mark.parametrize(
    "extra",
    [{}, dict(swiglu_limit=1.0, layer_types=["full_attention", "sliding_attention"] * 2), dict(rope_theta=10000.0)],
)
def test_a_gpt_oss_file_s_config_is_transformers(extra):
    """gpt-oss as a GGUF file's metadata gives it (its YaRN table, experts, window, clamp): every field the
    native decoder reads, and the DecoderArch (sinks, clamp, windows), transformers' GptOssConfig's."""
    from transformers import AutoConfig

    fields = dict(GPT_OSS_FILE, **extra)
    if "rope_theta" in extra:  # a table without its base: the config's own
        fields["rope_parameters"] = {k: v for k, v in fields["rope_parameters"].items() if k != "rope_theta"}
    theirs, ours = AutoConfig.for_model(**fields), config_view(fields)
    differ = {f: (getattr(ours, f, None), getattr(theirs, f, None)) for f in DECODER_FIELDS}
    assert {f: v for f, v in differ.items() if v[0] != v[1]} == {}
    assert ours.num_experts == theirs.num_experts == 8
    assert _described(ours) == _described(theirs)
