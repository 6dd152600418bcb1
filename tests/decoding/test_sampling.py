"""SamplingParams validation and the logits -> p transform."""

from __future__ import annotations

import math

import pytest
import torch

from fastdecode.decoding.sampling import SamplingParams, make_generator, probabilities
from fastdecode.errors import ConfigError

LOGITS = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0], [0.0, 3.0, -2.0, 1.0, 2.5]])  # [2, 5]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(temperature=-math.inf),
        dict(temperature="1.0"),
        dict(temperature=None),
        dict(top_p=0.0),
        dict(top_p=-0.5),
        dict(top_p=1.5),
        dict(top_p=math.nan),
        dict(top_p="0.9"),
        dict(top_k=-1),
        dict(top_k=True),
        dict(top_k=False),
        dict(top_k=2.0),
        dict(seed=-1),
        dict(seed=True),
        dict(seed=1.5),
        dict(seed="7"),
    ],
)
def test_nonsense_is_config_error(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(temperature=0),
        dict(temperature=0.7, top_k=5, top_p=0.9, seed=0),
        dict(top_p=1),
        dict(seed=2**40),
    ],
)
def test_sensible_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_greedy_iff_temperature_zero():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scaling_is_softmax_of_logits_over_t(temperature):
    p = probabilities(LOGITS, SamplingParams(temperature=temperature))
    torch.testing.assert_close(p, torch.softmax(LOGITS / temperature, dim=-1))


def test_lower_temperature_is_sharper():
    cold = probabilities(LOGITS, SamplingParams(temperature=0.3))
    hot = probabilities(LOGITS, SamplingParams(temperature=3.0))
    assert (cold.max(dim=-1).values > hot.max(dim=-1).values).all()


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0])
def test_top_k_1_puts_all_mass_on_argmax(temperature):
    p = probabilities(LOGITS, SamplingParams(temperature=temperature, top_k=1))
    expected = torch.nn.functional.one_hot(LOGITS.argmax(-1), LOGITS.shape[-1]).float()
    torch.testing.assert_close(p, expected)


def test_top_k_2_renormalizes_over_the_two_best():
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    # row 0 keeps tokens 0 and 2; row 1 keeps tokens 1 and 4
    expected = torch.zeros_like(LOGITS)
    expected[0, [0, 2]] = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    expected[1, [1, 4]] = torch.softmax(torch.tensor([3.0, 2.5]), -1)
    torch.testing.assert_close(p, expected)


@pytest.mark.parametrize("top_p", [1e-6, 0.01, 0.2])
def test_small_top_p_keeps_only_the_top_token(top_p):
    p = probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.nn.functional.one_hot(LOGITS.argmax(-1), LOGITS.shape[-1]).float()
    torch.testing.assert_close(p, expected)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.85))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.2]]))


def test_top_k_and_top_p_combine():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top_k=3 -> (0.4, 0.3, 0.2)/0.9; then top_p=0.5 keeps 0.444 + 0.333
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5))
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_is_float32_distribution(dtype):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    p = probabilities(logits, SamplingParams(temperature=0.8, top_k=10, top_p=0.9))
    assert p.dtype == torch.float32 and p.shape == (4, 50)
    torch.testing.assert_close(p.sum(-1), torch.ones(4))
    assert (p >= 0).all()
    assert ((p > 0).sum(-1) <= 10).all()


def test_make_generator_seeded_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=123)
    a = torch.rand(5, generator=make_generator(params, torch.device("cpu")))
    b = torch.rand(5, generator=make_generator(params, torch.device("cpu")))
    assert torch.equal(a, b)
    c = torch.rand(5, generator=make_generator(SamplingParams(temperature=1.0, seed=124), torch.device("cpu")))
    assert not torch.equal(a, c)


def test_make_generator_unseeded_differs():
    params = SamplingParams(temperature=1.0)
    a = torch.rand(5, generator=make_generator(params, torch.device("cpu")))
    b = torch.rand(5, generator=make_generator(params, torch.device("cpu")))
    assert not torch.equal(a, b)


def test_tiny_positive_temperature_gives_a_valid_distribution():
    params = SamplingParams(temperature=1e-38)  # finite and > 0: accepted
    p = probabilities(torch.tensor([[10.0, 1.0, 0.0]]), params)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0]]))
