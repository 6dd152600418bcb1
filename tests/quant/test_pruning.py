"""Pruning (fastdecode.quant.sparsity, fastdecode.quant.pruning): exact masks, Wanda's score,
SparseGPT's reconstruction, the compress command's round trip, and speculation against a pruned
model token-identical to plain decoding."""

import copy
import json

import pytest
import torch
from tiny_models import save_tiny_llama
from torch import nn

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.cli import main
from fastdecode.errors import ConfigError
from fastdecode.quant.api import config_from_method, quantize_, quantized_layers
from fastdecode.quant.math import gptq_hessian
from fastdecode.quant.pruning import PruneConfig, zero_fraction
from fastdecode.quant.serialization import PRUNED_JSON
from fastdecode.quant.sparsity import nm_mask, sparsegpt_prune, unstructured_mask, wanda_score

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]


def _decoder_linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}


# ---------------------------------------------------------------- masks and scores


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_keeps_exactly_n_of_every_m_along_the_inputs(n, m):
    score = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    keep = nm_mask(score, n, m)
    assert (keep.view(8, -1, m).sum(-1) == n).all()
    # the kept ones are the group's largest
    groups, kept = score.view(8, -1, m), keep.view(8, -1, m)
    assert (groups.masked_fill(~kept, float("inf")).amin(-1) >= groups.masked_fill(kept, -float("inf")).amax(-1)).all()


def test_unstructured_mask_prunes_the_exact_ratio_per_layer_or_per_row():
    score = torch.rand(6, 10, generator=torch.Generator().manual_seed(1))
    assert int((~unstructured_mask(score, 0.3)).sum()) == 18
    per_row = unstructured_mask(score, 0.3, per_row=True)
    assert ((~per_row).sum(1) == 3).all()
    with pytest.raises(ConfigError):
        unstructured_mask(score, 1.0)
    with pytest.raises(ConfigError):
        nm_mask(torch.rand(2, 6), 2, 4)  # 4 does not divide 6


def test_wanda_score_is_weight_magnitude_times_input_channel_norm():
    w = torch.tensor([[1.0, -2.0, 0.5], [-3.0, 0.25, 1.0]])
    x = torch.tensor([[3.0, 0.0, 1.0], [4.0, 1.0, -1.0]])  # ||X_j||_2 = 5, 1, sqrt(2)
    expected = torch.tensor([[5.0, 2.0, 0.5 * 2**0.5], [15.0, 0.25, 2**0.5]])
    torch.testing.assert_close(wanda_score(w, x.norm(dim=0)), expected)
    # per output row: row 0 drops its smallest score (w=0.5 · sqrt 2), row 1 its (w=0.25 · 1)
    assert unstructured_mask(expected, 1 / 3, per_row=True).tolist() == [[True, True, False], [True, False, True]]


def _layer_inputs(seed=0, tokens=256, width=64):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width**0.5
    return torch.randn(tokens, width, generator=g) @ (torch.eye(width) + mix)  # correlated channels


@pytest.mark.parametrize("shape", [dict(sparsity=0.5), dict(pattern=(2, 4))])
def test_sparsegpt_reconstructs_better_than_its_mask_alone(shape):
    x = _layer_inputs()
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    pruned = sparsegpt_prune(w, gptq_hessian(x), blocksize=32, **shape)
    keep = pruned != 0
    if "pattern" in shape:
        assert (keep.view(16, -1, 4).sum(-1) == 2).all()
    else:
        assert int((~keep).sum()) == 16 * 64 // 2
    reference = x @ w.T
    mask_alone = float((x @ (w * keep).T - reference).pow(2).mean())
    reconstructed = float((x @ pruned.T - reference).pow(2).mean())
    assert reconstructed < 0.8 * mask_alone


# ---------------------------------------------------------------- the method on a model


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_each_decoder_linear_gets_exactly_the_sparsity_asked(quant_llama, calibration_ids, method):
    settings = {} if method == "magnitude" else {"calibration_token_ids": calibration_ids}
    quantize_(quant_llama, config_from_method(method, sparsity=0.5, **settings))
    for name, linear in _decoder_linears(quant_llama).items():
        assert int((linear.weight == 0).sum()) == linear.weight.numel() // 2, name
    assert bool((quant_llama.lm_head.weight != 0).all())  # the LM head is not pruned


def test_pattern_and_then_q8_0_keep_the_zeros_in_the_blocks(quant_llama, calibration_ids):
    config = config_from_method("wanda", pattern="2:4", then="q8_0", calibration_token_ids=calibration_ids)
    assert config.pattern == (2, 4) and config.format == "q8_0"
    quantize_(quant_llama, config)
    layers = quantized_layers(quant_llama)
    assert len(layers) == 14 and {v["format"] for v in layers.values()} == {"q8_0"}
    w = quant_llama.model.layers[0].mlp.down_proj.dequantize()
    assert ((w != 0).view(w.shape[0], -1, 4).sum(-1) <= 2).all()
    assert zero_fraction(quant_llama) >= 0.5


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_sparsegpt_rounds_jointly_into_block_layers(quant_llama, calibration_ids, probe_ids, run_logits, fmt):
    reference = run_logits(quant_llama, probe_ids)
    config = config_from_method("sparsegpt", pattern="2:4", then=fmt, calibration_token_ids=calibration_ids)
    assert config.joint_format == fmt
    quantize_(quant_llama, config)
    w = quant_llama.model.layers[1].self_attn.q_proj.dequantize()
    assert ((w != 0).view(w.shape[0], -1, 4).sum(-1) <= 2).all()
    assert float((run_logits(quant_llama, probe_ids) - reference).norm() / reference.norm()) < 1.0


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="not both"):
        PruneConfig(sparsity=0.5, pattern=(2, 4))
    with pytest.raises(ConfigError, match="N:M"):
        config_from_method("wanda", pattern="4:4")
    with pytest.raises(ConfigError, match="--then takes"):
        config_from_method("wanda", then="wanda")
    with pytest.raises(ConfigError, match="fill"):
        config_from_method("sparsegpt", then="int4-gptq")
    with pytest.raises(ConfigError, match="without --then"):
        config_from_method("magnitude", group_size=32)


# ---------------------------------------------------------------- speculation against a pruned model


@pytest.fixture(scope="module")
def pruned_model(tiny_model):
    model = copy.deepcopy(tiny_model)
    calibration = [torch.randint(3, 96, (64,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    quantize_(model, PruneConfig("sparsegpt", pattern=(2, 4), calibration_token_ids=calibration))
    return model


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculation_on_a_pruned_model_is_token_identical_to_plain(pruned_model, tokenizer, drafter):
    plain = Engine(pruned_model, tokenizer, target=make_target(pruned_model, "native")).generate(
        PROMPT, max_new_tokens=40
    )
    draft = build_drafter("ngram", n=3) if drafter == "ngram" else build_drafter("draft-model", model=pruned_model, k=3)
    engine = Engine(pruned_model, tokenizer, drafter=draft, target=make_target(pruned_model, "native"))
    result = engine.generate(PROMPT, max_new_tokens=40, draft_k=3)
    assert result.token_ids == plain.token_ids
    assert result.acceptance.drafted_tokens > 0


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _compress(capsys, model_dir, out, *args):
    code = main(["compress", str(model_dir), "--out", str(out), "--eval-windows", "1", "--window", "32", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_compress_prunes_saves_and_reports_and_the_directory_loads(capsys, model_dir, tmp_path, short_evaluation_text):
    out = _compress(capsys, model_dir, tmp_path / "w", "--method", "wanda", "--sparsity", "0.5")
    assert "wanda 50% unstructured: 50.0% of the decoder layers' weights are 0" in out
    assert "top-1 agreement" in out and "runs as float" in out
    record = json.loads((tmp_path / "w" / PRUNED_JSON).read_text())["compression"]
    assert record["method"] == "wanda" and "calibration_text()" in record["calibration"]
    main(["generate", "--model", str(tmp_path / "w"), "--prompt", "w1 w2 w3", "--no-chat", "--max-new-tokens", "4"])
    assert capsys.readouterr().out.strip()

    out = _compress(capsys, model_dir, tmp_path / "s", "--method", "sparsegpt", "--pattern", "2:4", "--then", "q8_0")
    assert "sparsegpt 2:4 then q8_0" in out and "runs as q8_0" in out


def test_compress_output_off_a_terminal_has_no_progress_bar(capsys, model_dir, tmp_path):
    args = ["compress", str(model_dir), "--out", str(tmp_path / "m"), "--eval-windows", "0"]
    assert main([*args, "--method", "magnitude", "--pattern", "2:4"]) == 0
    captured = capsys.readouterr()
    assert "decoder layers" not in captured.err  # (transformers' own shard-writing bar aside)
    assert "\r" not in captured.out and "\x1b" not in captured.out
    assert captured.out.splitlines()[1] == "magnitude 2:4: 50.0% of the decoder layers' weights are 0"


def test_compress_refuses_bad_pruning_options_with_one_error(capsys, model_dir, tmp_path):
    code = main(["compress", str(model_dir), "--method", "wanda", "--pattern", "3", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 1 and "N:M pattern" in err and "Traceback" not in err
