"""SmoothQuant W8A8 (fastdecode.quant.smoothquant): the smoothing exact in float, w8a8 layers (int8
per channel x int8 per token; q8_0 blocks as an option), and speculation against it token-identical
to plain decoding."""

import copy
import json

import pytest
import torch
from torch import nn

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.errors import ConfigError
from fastdecode.quant.api import SmoothQuantConfig, config_from_method, quantize_, quantized_layers
from fastdecode.quant.calibration import collect_activation_stats
from fastdecode.quant.serialization import QUANT_JSON, load_quantized, save_quantized
from fastdecode.quant.smoothing import fold_scales, smoothing_groups
from fastdecode.quant.smoothquant import smoothing_scales

DECODER_LINEARS = 14  # 2 layers x 7
PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_scales_follow_the_papers_formula():
    abs_max_x = torch.tensor([16.0, 1.0, 4.0, 0.0])
    weight = torch.tensor([[1.0, -4.0, 0.5, 1.0], [-0.25, 2.0, 1.0, 3.0]])  # max |W_j| = 1, 4, 1, 3
    s = smoothing_scales(abs_max_x, weight, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([4.0, 0.5, 2.0, 1.0]))  # a channel that never fires keeps 1
    torch.testing.assert_close(smoothing_scales(abs_max_x[:3], weight[:, :3], alpha=1.0), abs_max_x[:3])


def test_smoothing_before_rounding_is_the_float_model(quant_llama, calibration_ids, probe_ids, run_logits):
    reference = run_logits(quant_llama, probe_ids)
    groups = smoothing_groups(quant_llama, ("attn_in", "mlp_in"))
    samples = [torch.tensor(ids) for ids in calibration_ids]
    stats = collect_activation_stats(quant_llama, {g.names[0]: g.linears[0] for g in groups}, samples)
    for group in groups:
        weight = torch.cat([linear.weight.detach() for linear in group.linears])
        s = smoothing_scales(stats[group.names[0]].abs_max, weight, 0.5)
        assert float((s - 1).abs().max()) > 0.5  # the scales do move something
        fold_scales(group, s)
    torch.testing.assert_close(run_logits(quant_llama, probe_ids), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothquant_gives_w8a8_layers_close_to_float(quant_llama, calibration_ids, probe_ids, run_logits, alpha):
    reference = run_logits(quant_llama, probe_ids)
    quantize_(quant_llama, config_from_method("smoothquant", alpha=alpha, calibration_token_ids=calibration_ids))
    layers = quantized_layers(quant_llama)
    assert len(layers) == DECODER_LINEARS
    assert {layer["kind"] for layer in layers.values()} == {"w8a8"}
    assert type(quant_llama.lm_head) is nn.Linear
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.02


def test_smoothquant_in_q8_0_blocks_on_request(quant_llama, calibration_ids, probe_ids, run_logits):
    reference = run_logits(quant_llama, probe_ids)
    config = config_from_method("smoothquant", format="q8_0", calibration_token_ids=calibration_ids)
    quantize_(quant_llama, config)
    layers = quantized_layers(quant_llama)
    assert {(layer["kind"], layer["format"]) for layer in layers.values()} == {("gguf_block", "q8_0")}
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.02  # q8_0 alone gives ~0.007 here


@pytest.mark.parametrize("smooth_head", [True, False])
def test_a_quantized_tied_head_is_smoothed_into_the_final_norm_leaving_the_embeddings(
    build_llama, calibration_ids, probe_ids, run_logits, smooth_head
):
    model = build_llama(tie_word_embeddings=True)
    reference = run_logits(model, probe_ids)
    embeddings, norm = model.model.embed_tokens.weight.detach().clone(), model.model.norm.weight.detach().clone()
    config = SmoothQuantConfig(calibration_token_ids=calibration_ids, smooth_head=smooth_head)
    quantize_(model, config, skip=())
    assert type(model.lm_head).__name__ == "W8A8Linear"
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    assert torch.equal(model.model.norm.weight, norm) != smooth_head
    assert _rel(run_logits(model, probe_ids), reference) < 0.02
    assert model.config.tie_word_embeddings is False  # saved, loaders must read the head's own tensors


def test_a_skipped_tied_head_stays_tied(build_llama, calibration_ids):
    model = build_llama(tie_word_embeddings=True)
    quantize_(model, SmoothQuantConfig(calibration_token_ids=calibration_ids))  # default skip: lm_head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is True


def test_a_quantized_tied_head_loads_back_untied(build_llama, calibration_ids, probe_ids, run_logits, tmp_path):
    model = build_llama(tie_word_embeddings=True)
    config = SmoothQuantConfig(calibration_token_ids=calibration_ids)
    quantize_(model, config, skip=())
    save_quantized(model, None, tmp_path, config)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    loaded, _ = load_quantized(tmp_path)
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(model, probe_ids))


def test_save_and_load_give_identical_logits(quant_llama, calibration_ids, probe_ids, run_logits, tmp_path):
    config = SmoothQuantConfig(calibration_token_ids=calibration_ids)
    quantize_(quant_llama, config)
    save_quantized(quant_llama, None, tmp_path, config)
    loaded, _ = load_quantized(tmp_path)
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(quant_llama, probe_ids))
    assert torch.equal(
        loaded.model.layers[1].post_attention_layernorm.weight,
        quant_llama.model.layers[1].post_attention_layernorm.weight,
    )
    assert json.loads((tmp_path / QUANT_JSON).read_text())["quantization"]["method"] == "smoothquant"


def test_config_checks_its_settings():
    assert config_from_method("smoothquant").alpha == 0.5
    assert config_from_method("smoothquant").groups == ("attn_in", "mlp_in", "mlp_out")  # w8a8: down_proj too
    assert config_from_method("smoothquant", format="q8_0").groups == ("attn_in", "mlp_in")  # the paper's
    with pytest.raises(ConfigError, match="alpha"):
        SmoothQuantConfig(alpha=1.5)
    with pytest.raises(ConfigError, match="group size"):
        config_from_method("smoothquant", group_size=32)
    with pytest.raises(ConfigError, match="W8A8"):
        config_from_method("smoothquant", bits=4)
    with pytest.raises(ConfigError, match="W8A8 in w8a8 or q8_0"):
        config_from_method("smoothquant", format="q4_0")


# ---------------------------------------------------------------- speculation against it


@pytest.fixture(scope="module", params=["w8a8", "q8_0"])
def smoothquant_model(tiny_model, request):
    model = copy.deepcopy(tiny_model)
    calibration = [torch.randint(3, 96, (64,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    quantize_(model, SmoothQuantConfig(format=request.param, calibration_token_ids=calibration))
    return model


@pytest.fixture(scope="module")
def plain(smoothquant_model, tokenizer):
    target = make_target(smoothquant_model, "native")
    assert target.weights in ("w8a8+float", "q8_0+float")  # the decoder layers saved low-bit, the float LM head
    assert target._layer_calls is not None  # every decoder projection on the C kernels, one call a pass
    return Engine(smoothquant_model, tokenizer, target=target).generate(PROMPT, max_new_tokens=40)


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_is_token_identical_to_plain_decoding(smoothquant_model, tokenizer, plain, drafter):
    if drafter == "ngram":
        draft = build_drafter("ngram", n=3)
    else:  # the model drafting for itself: every draft is accepted
        draft = build_drafter("draft-model", model=smoothquant_model, k=3)
    engine = Engine(smoothquant_model, tokenizer, drafter=draft, target=make_target(smoothquant_model, "native"))
    result = engine.generate(PROMPT, max_new_tokens=40, draft_k=3)
    assert result.token_ids == plain.token_ids
    assert result.acceptance.drafted_tokens > 0
