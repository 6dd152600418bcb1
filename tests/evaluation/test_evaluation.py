"""Quality evaluation: the windowing convention, perplexity as transformers computes it,
agreement and KL against the float model."""

import math

import pytest
import torch
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode.backends import make_target
from fastdecode.errors import ConfigError
from fastdecode.evaluation.quality import EvalOptions, Window, score_windows, windows

TEXT = "the quick brown fox jumps over the lazy dog; " * 6  # 270 characters: 271 tokens with the BOS


def test_windows_follow_the_convention_in_a_hand_computed_case():
    spans = windows(10, 4)
    assert spans == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    assert [w.num_predicted for w in spans] == [3, 3, 1]


def test_a_smaller_stride_predicts_each_position_once_with_context_before_it():
    spans = windows(10, 4, 2)
    assert spans == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert sum(w.num_predicted for w in spans) == 9  # every token but the first


def test_a_last_window_of_one_token_predicts_nothing_and_is_left_out():
    assert windows(9, 4) == [Window(0, 4, 1), Window(4, 8, 5)]
    assert windows(1, 4) == []


@pytest.mark.parametrize("window, stride", [(1, None), (4, 0), (4, 5)])
def test_bad_window_or_stride_is_one_config_error(window, stride):
    with pytest.raises(ConfigError, match="window|stride"):
        windows(10, window, stride)


def test_eval_options_are_checked():
    with pytest.raises(ConfigError, match="max_windows"):
        EvalOptions(max_windows=0)


def _transformers_perplexity(model, ids, spans):
    """exp(mean NLL) from transformers' own loss, each window scored alone."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in spans:
            x = torch.tensor([ids[w.start : w.end]])
            nll += float(model(input_ids=x, labels=x).loss) * (w.end - w.start - 1)
            count += w.end - w.start - 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_perplexity_equals_a_direct_computation_with_transformers_loss(tiny_model, tokenizer, backend):
    ids = tokenizer(TEXT)["input_ids"]
    spans = windows(len(ids), 64)
    expected, count = _transformers_perplexity(tiny_model, ids, spans)
    scores = score_windows(make_target(tiny_model, backend, "float"), ids, spans, chunk_tokens=24)
    assert scores.count == count == len(ids) - len(spans)
    assert scores.perplexity == pytest.approx(expected, rel=1e-5)


def test_chunking_does_not_change_the_figures(tiny_model, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    spans = windows(len(ids), 100, 60)
    target = make_target(tiny_model, "native", "float")
    one = score_windows(target, ids, spans, chunk_tokens=100)
    small = score_windows(target, ids, spans, chunk_tokens=7)
    assert small.count == one.count and small.nll == pytest.approx(one.nll, rel=1e-6)


def test_the_float_model_against_itself_agrees_everywhere_with_zero_kl(tiny_model, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    spans = windows(len(ids), 64)
    target, reference = make_target(tiny_model, "native", "float"), make_target(tiny_model, "native", "float")
    scores = score_windows(target, ids, spans, reference=reference, chunk_tokens=32)
    assert scores.agree == scores.count
    assert abs(scores.kl / scores.count) < 1e-7
    assert scores.reference_perplexity == pytest.approx(scores.perplexity, rel=1e-6)


def test_low_bit_weights_move_away_from_the_float_model(tokenizer):
    model = tiny_llama(0, **KERNEL_FRIENDLY)
    ids = tokenizer(TEXT)["input_ids"]
    spans = windows(len(ids), 64)
    float_ref = make_target(model, "native", "float")
    scores = score_windows(make_target(model, "native", "q4_0"), ids, spans, reference=float_ref)
    kl = scores.kl / scores.count
    assert 0 < kl < 1  # nats per token: rounding moves the distribution a little, never negatively
    assert 0 < scores.agree <= scores.count
    assert scores.perplexity != scores.reference_perplexity
