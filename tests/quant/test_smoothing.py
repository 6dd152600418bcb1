"""Per-channel scales folded before a group of linears (fastdecode.quant.smoothing): the float
model's function unchanged, on a Llama with grouped-query attention and on Gemma 3's norms."""

import pytest
import torch
from tiny_models import tiny_gemma3, tiny_llama

from fastdecode.errors import ConfigError
from fastdecode.quant.smoothing import PAIRS, fold_scales, smoothing_groups

BUILDERS = {"llama": tiny_llama, "gemma3": tiny_gemma3}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _random_scales(group, generator):
    """Scales spanning 1/4 .. 4, tied across the heads that share a kv head where they must be."""
    s = torch.exp(torch.empty(group.in_features).uniform_(-1.4, 1.4, generator=generator))
    return group.tie_heads(s)


@pytest.mark.parametrize("arch", BUILDERS)
def test_folding_any_scales_leaves_the_float_model_unchanged(arch):
    model = BUILDERS[arch](0)
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    reference = _logits(model, ids)
    generator = torch.Generator().manual_seed(2)
    groups = smoothing_groups(model)
    assert [g.kind for g in groups] == list(PAIRS) * model.config.num_hidden_layers
    for group in groups:
        fold_scales(group, _random_scales(group, generator))
    smoothed = _logits(model, ids)
    assert not torch.equal(
        model.model.layers[0].input_layernorm.weight, BUILDERS[arch](0).model.layers[0].input_layernorm.weight
    )
    torch.testing.assert_close(smoothed, reference, atol=1e-5, rtol=0)


def test_gemma_norm_folds_into_its_effective_weight():
    model = tiny_gemma3(0)
    norm = model.model.layers[0].pre_feedforward_layernorm
    w = norm.weight.detach().clone()
    group = next(g for g in smoothing_groups(model, ("mlp_in",)) if g.prev is norm)
    assert group.norm_offset == 1.0 and group.names[0].endswith("mlp.gate_proj")
    s = torch.linspace(0.5, 2.0, group.in_features)
    fold_scales(group, s)
    torch.testing.assert_close(norm.weight.detach(), ((1 + w.double()) / s - 1).float())


def test_llama_norm_divides_its_weight_and_linears_scale_their_columns():
    model = tiny_llama(0)
    layer = model.model.layers[1]
    w_norm, w_up = layer.post_attention_layernorm.weight.detach().clone(), layer.mlp.up_proj.weight.detach().clone()
    group = [g for g in smoothing_groups(model, ("mlp_in",))][1]
    s = torch.linspace(0.5, 2.0, group.in_features)
    fold_scales(group, s)
    torch.testing.assert_close(layer.post_attention_layernorm.weight.detach(), w_norm / s)
    torch.testing.assert_close(layer.mlp.up_proj.weight.detach(), w_up * s)


def test_value_scales_are_one_per_kv_channel():
    model = tiny_llama(0)  # 4 query heads, 2 kv heads: each value channel read by 2 heads
    group = smoothing_groups(model, ("attn_out",))[0]
    assert group.kv_repeat == 2 and group.head_dim == 8
    stat = torch.arange(float(group.in_features))
    tied = group.tie_heads(stat).view(2, 2, 8)  # [kv heads, repeat, head_dim]
    assert torch.equal(tied[:, 0], tied[:, 1])
    torch.testing.assert_close(tied[0, 0], (stat[:8] + stat[8:16]) / 2)
    untied = torch.ones(group.in_features)
    untied[0] = 2.0  # head 0 and head 1 (one kv head) would need different value scales
    with pytest.raises(ConfigError, match="kv head"):
        fold_scales(group, untied)


def test_scales_must_be_positive_and_of_the_input_width():
    group = smoothing_groups(tiny_llama(0), ("attn_in",))[0]
    with pytest.raises(ConfigError, match="positive"):
        fold_scales(group, torch.zeros(group.in_features))
    with pytest.raises(ConfigError, match="positive"):
        fold_scales(group, torch.ones(group.in_features + 1))


def test_unknown_layouts_and_groups_are_named():
    with pytest.raises(ConfigError, match="decoder layouts"):
        smoothing_groups(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ConfigError, match="unknown smoothing groups"):
        smoothing_groups(tiny_llama(0), ("qkv",))


def test_a_norm_with_a_bias_is_refused_not_folded(build_llama):
    """A LayerNorm's bias would not be divided by the scales: smoothing refuses the layout."""
    import torch.nn as nn

    from fastdecode.errors import ConfigError
    from fastdecode.quant.smoothing import smoothing_groups

    model = build_llama()
    layer = model.model.layers[-1]
    layer.input_layernorm = nn.LayerNorm(layer.input_layernorm.weight.shape[0])
    with pytest.raises(ConfigError, match="smoothing knows"):
        smoothing_groups(model)
