"""AWQ (fastdecode.quant.awq) and the calibration statistics it uses (fastdecode.quant.calibration),
on the tiny random-weight Llama whose shapes fit the low-bit kernels (tests/quant/conftest.py)."""

import json

import pytest
import torch
from tiny_models import tiny_gemma3
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats import compress_method_names, draft_quant_names, quant_method_names, weight_format_names
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.quant.api import AWQConfig, config_from_method, quantize_, quantized_layers
from fastdecode.quant.awq import Rounding, fake_quantize_blocks, group_error, search_scales
from fastdecode.quant.calibration import CalibrationSettings, calibration_samples, collect_activation_stats
from fastdecode.quant.linear import GGUFBlockLinear, Int4WeightOnlyLinear
from fastdecode.quant.serialization import QUANT_JSON, load_quantized, save_quantized
from fastdecode.quant.smoothing import fold_scales, smoothing_groups

DECODER_LINEARS = 14  # 2 layers x 7


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _awq(calibration_ids, **settings):
    return AWQConfig(calibration_token_ids=calibration_ids, **settings)


# ---------------------------------------------------------------- calibration


class ByteTokenizer:
    """Each character -> one id in 3..127 (what calibration_samples needs of a tokenizer)."""

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 125 for c in text]}


def test_calibration_cuts_the_shipped_text_into_full_windows():
    samples = calibration_samples(CalibrationSettings(num_sequences=3, seq_len=50), ByteTokenizer())
    assert [len(s) for s in samples] == [50, 50, 50]
    short = calibration_samples(CalibrationSettings(num_sequences=4, seq_len=8, text="abcdefghijkl"), ByteTokenizer())
    assert [len(s) for s in short] == [8]  # the short tail is dropped where a full window exists
    with pytest.raises(ConfigError, match="tokenizer"):
        calibration_samples(CalibrationSettings(), None)


def test_statistics_are_those_of_each_layers_input(quant_llama, calibration_ids):
    samples = [torch.tensor(ids) for ids in calibration_ids]  # 4 x 64 tokens
    layer = quant_llama.model.layers[0]
    seen = []
    handle = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, 64)))
    with torch.no_grad():
        for ids in samples:
            quant_llama(input_ids=ids[None])
    handle.remove()
    x = torch.cat(seen)  # [256, 64]
    stats = collect_activation_stats(
        quant_llama, {"q": layer.self_attn.q_proj, "down": layer.mlp.down_proj}, samples, keep_rows=("q",), max_rows=100
    )
    q = stats["q"]
    assert q.tokens == 256
    torch.testing.assert_close(q.abs_max, x.abs().amax(0))
    torch.testing.assert_close(q.abs_mean, x.abs().mean(0))
    kept = q.inputs()
    assert kept.shape[0] <= 100  # memory bounded by max_rows
    torch.testing.assert_close(kept, x[:: 256 // 100][: kept.shape[0]])
    assert not stats["down"].rows


# ---------------------------------------------------------------- the search


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_the_search_rounds_as_the_saved_blocks_do(fmt):
    w = torch.randn(24, 80, generator=torch.Generator().manual_seed(3))  # 80: a padded last block
    assert torch.equal(fake_quantize_blocks(w, fmt), BlockTensor.quantize(w, fmt).dequantize())


def test_the_searched_scales_are_never_worse_than_plain_rounding(quant_llama, calibration_ids):
    samples = [torch.tensor(ids) for ids in calibration_ids]
    groups = smoothing_groups(quant_llama)
    stats = collect_activation_stats(
        quant_llama, {g.names[0]: g.linears[0] for g in groups}, samples, keep_rows=[g.names[0] for g in groups]
    )
    for fmt in ("q4_0", "q4_1", "int4"):
        rounding = Rounding(fmt, 32)
        for group in groups:
            x = stats[group.names[0]].inputs()
            weight = torch.cat([linear.weight.detach() for linear in group.linears])
            s, alpha, errors = search_scales(x, weight, group.tie_heads(stats[group.names[0]].abs_mean), 10, rounding)
            rtn = group_error(x, weight, torch.ones(group.in_features), rounding)
            assert errors[0] == pytest.approx(rtn)  # alpha = 0 is round-to-nearest
            assert group_error(x, weight, s, rounding) == pytest.approx(min(errors))
            assert min(errors) <= rtn
            assert 0 <= alpha <= 1


def test_scaling_protects_the_channels_that_meet_large_activations():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=generator)
    x[:, :4] *= 30  # salient input channels
    weight = torch.randn(48, 64, generator=generator)
    _, alpha, errors = search_scales(x, weight, x.abs().mean(0), 20, Rounding("q4_0", 32))
    assert alpha > 0 and min(errors) < 0.8 * errors[0]


# ---------------------------------------------------------------- the method


@pytest.mark.parametrize(
    "fmt, module", [("q4_0", GGUFBlockLinear), ("q4_1", GGUFBlockLinear), ("int4", Int4WeightOnlyLinear)]
)
def test_awq_quantizes_every_decoder_linear_close_to_float(
    quant_llama, calibration_ids, probe_ids, run_logits, fmt, module
):
    reference = run_logits(quant_llama, probe_ids)
    quantize_(quant_llama, _awq(calibration_ids, format=fmt, grid=10, clip_grid=10))
    layers = quantized_layers(quant_llama)
    assert len(layers) == DECODER_LINEARS and all(isinstance(quant_llama.get_submodule(n), module) for n in layers)
    assert type(quant_llama.lm_head) is nn.Linear
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.15  # q4 RTN gives ~0.09 on this model


def test_awq_before_rounding_is_the_float_model(quant_llama, calibration_ids, probe_ids, run_logits):
    """With rounding made the identity, only the folded scales remain: the float function is kept."""
    reference = run_logits(quant_llama, probe_ids)
    config = _awq(calibration_ids, grid=4, clip=False)
    samples = [torch.tensor(ids) for ids in calibration_ids]
    groups = smoothing_groups(quant_llama)
    stats = collect_activation_stats(
        quant_llama, {g.names[0]: g.linears[0] for g in groups}, samples, keep_rows=[g.names[0] for g in groups]
    )
    for group in groups:
        weight = torch.cat([linear.weight.detach() for linear in group.linears])
        x = stats[group.names[0]].inputs()
        s, _, _ = search_scales(
            x, weight, group.tie_heads(stats[group.names[0]].abs_mean), config.grid, Rounding("q4_0", 32)
        )
        fold_scales(group, s)
    torch.testing.assert_close(run_logits(quant_llama, probe_ids), reference, atol=1e-5, rtol=0)


def test_save_and_load_give_identical_logits_and_keep_the_folded_norms(
    quant_llama, calibration_ids, probe_ids, run_logits, tmp_path
):
    original_norm = quant_llama.model.layers[0].input_layernorm.weight.detach().clone()
    config = config_from_method("awq", group_size=32, format="q4_0", calibration_token_ids=calibration_ids, grid=5)
    quantize_(quant_llama, config)
    folded = quant_llama.model.layers[0].input_layernorm.weight.detach()
    assert not torch.equal(folded, original_norm)
    save_quantized(quant_llama, None, tmp_path, config)
    loaded, _ = load_quantized(tmp_path)
    assert torch.equal(loaded.model.layers[0].input_layernorm.weight, folded)
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(quant_llama, probe_ids))
    record = json.loads((tmp_path / QUANT_JSON).read_text())
    assert record["quantization"]["method"] == "awq" and record["quantization"]["format"] == "q4_0"
    assert {layer["kind"] for layer in record["layers"].values()} == {"gguf_block"}
    assert {layer["format"] for layer in record["layers"].values()} == {"q4_0"}


def test_awq_and_smoothquant_are_compression_methods_not_weight_formats():
    for name in ("awq", "smoothquant"):
        assert name in compress_method_names() and name in quant_method_names()
        assert name not in weight_format_names()
        # a drafter may be one: --draft-quant calibrates a private copy of the draft model
        assert draft_quant_names()[-2:] == ("awq", "smoothquant")


def test_awq_config_checks_its_settings():
    assert config_from_method("awq").format == "q4_0"
    assert config_from_method("awq", group_size=64, format="int4").group_size == 64
    with pytest.raises(ConfigError, match="blocks of 32"):
        config_from_method("awq", group_size=64, format="q4_0")
    with pytest.raises(ConfigError, match="output format"):
        config_from_method("awq", format="q8_0")
    with pytest.raises(ConfigError, match="4-bit"):
        config_from_method("awq", bits=8)
    with pytest.raises(ConfigError, match="alpha"):
        config_from_method("awq", alpha=0.5)
    with pytest.raises(ConfigError, match="num_sequences"):
        AWQConfig(num_sequences=0)


def test_awq_on_gemma3_folds_into_its_offset_norms(calibration_ids, probe_ids, run_logits):
    model = tiny_gemma3(0, vocab_size=128)
    reference = run_logits(model, probe_ids)
    norm = model.model.layers[0].pre_feedforward_layernorm.weight.detach().clone()
    quantize_(model, _awq(calibration_ids, grid=5, clip=False))
    assert len(quantized_layers(model)) == 3 * 7
    assert not torch.equal(model.model.layers[0].pre_feedforward_layernorm.weight, norm)
    assert _rel(run_logits(model, probe_ids), reference) < 0.3  # q4_0 RTN gives 0.27 on this model, AWQ 0.23
