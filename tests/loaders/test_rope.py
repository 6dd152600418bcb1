"""RoPE inverse frequencies (``loaders/rope.py``) bit for bit those of transformers' ``ROPE_INIT_FUNCTIONS``,
for every RoPE type written there, on transformers' configs and on fastdecode's config views."""

from __future__ import annotations

import pytest
import torch

from fastdecode.architectures.config_view import config_view
from fastdecode.loaders.rope import rope_inv_freq

BASE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
LLAMA3 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
CASES = {
    "llama3": dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=8192), rope_theta=500000.0),
    "llama3-head-dim": dict(
        rope_scaling=dict(LLAMA3, factor=8.0, original_max_position_embeddings=1024), rope_theta=10000.0, head_dim=32
    ),
    "linear": dict(rope_scaling=dict(rope_type="linear", factor=4.0), rope_theta=10000.0),
    "linear-partial": dict(rope_scaling=dict(rope_type="linear", factor=2.5), partial_rotary_factor=0.5),
    "yarn": dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)),
    "yarn-betas": dict(
        rope_scaling=dict(
            rope_type="yarn", factor=16.0, original_max_position_embeddings=512, beta_fast=16, beta_slow=2
        ),
        rope_theta=150000.0,
    ),
    "yarn-mscale": dict(
        rope_scaling=dict(
            rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=1.0
        )
    ),
    "yarn-untruncated": dict(
        rope_scaling=dict(
            rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False, beta_fast=32.0
        ),
        rope_theta=150000.0,
    ),
    "yarn-attention-factor": dict(
        rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=2048, attention_factor=1.25)
    ),
}


def _theirs(config, layer_type=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_inverse_frequencies_are_transformers(case):
    from transformers import AutoConfig

    fields = dict(BASE, **CASES[case])
    for config in (AutoConfig.for_model("llama", **fields), config_view(dict(fields, model_type="llama"))):
        got, got_scale = rope_inv_freq(config, config.rope_parameters)
        expected, expected_scale = _theirs(config)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (case, type(config).__name__)
        assert got_scale == expected_scale


def test_per_layer_type_linear_is_transformers():
    from transformers import AutoConfig

    fields = dict(
        BASE,
        head_dim=64,
        num_hidden_layers=6,
        sliding_window=8,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
        },
    )
    for config in (AutoConfig.for_model("gemma3_text", **fields), config_view(dict(fields, model_type="gemma3_text"))):
        for layer_type in ("full_attention", "sliding_attention"):
            got, scale = rope_inv_freq(config, config.rope_parameters[layer_type], layer_type)
            if layer_type == "full_attention":
                expected, expected_scale = _theirs(config, layer_type)
                assert torch.equal(got, expected) and scale == expected_scale
            assert got.shape == (32,)
