"""Verification: worked greedy cases, and statistical tests that speculative
rejection sampling emits exactly the target distribution p.

Statistical tests use a chi-square goodness-of-fit test at significance level
ALPHA = 0.001 with fixed generator seeds, so each run is deterministic; the
negative controls run the same test on samplers that are known to be wrong and
show it rejects them, i.e. that the test has power.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest, chisquare

from fastdecode.decoding.verify import verify_greedy, verify_sampling

ALPHA = 0.001
TRIALS = 20_000

# --- verify_greedy ------------------------------------------------------------


def test_greedy_all_accepted_bonus_is_last_argmax():
    assert verify_greedy([5, 6, 7], torch.tensor([5, 6, 7, 4])) == (3, 4)


@pytest.mark.parametrize(
    "draft, argmax, expected",
    [
        ([5, 6, 7], [9, 6, 7, 4], (0, 9)),  # first position wrong
        ([5, 6, 7], [5, 6, 9, 4], (2, 9)),  # last position wrong
        ([5, 6, 7], [5, 8, 7, 4], (1, 8)),  # later matches after a mismatch do not count
        ([3], [3, 1], (1, 1)),
        ([3], [2, 1], (0, 2)),
    ],
)
def test_greedy_first_mismatch(draft, argmax, expected):
    assert verify_greedy(draft, torch.tensor(argmax)) == expected


def test_greedy_empty_draft_returns_argmax_of_first_position():
    assert verify_greedy([], torch.tensor([11])) == (0, 11)


def test_greedy_returns_python_ints():
    n, bonus = verify_greedy([1, 2], torch.tensor([1, 2, 3]))
    assert type(n) is int and type(bonus) is int


# --- verify_sampling: deterministic cases -------------------------------------


def test_sampling_certain_acceptance_and_bonus():
    # p is one-hot on each draft token and on token 4 at the bonus position
    p = torch.zeros(3, 6)
    p[0, 1] = p[1, 2] = p[2, 4] = 1.0
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert verify_sampling([1, 2], p, None, gen) == (2, 4)


def test_sampling_token_with_p_zero_is_always_rejected_and_never_recovered():
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for q_arg in (None, q):
        for _ in range(200):
            n, token = verify_sampling([0], p, q_arg, gen)
            assert n == 0 and token in (1, 2)


def test_sampling_token_with_p_and_q_both_zero_is_rejected():
    # the target never emits token 0, whatever the drafter claimed about it
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 0.5, 0.5]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, token = verify_sampling([0], p, q, gen)
        assert n == 0 and token in (1, 2)


def test_sampling_token_with_q_zero_but_p_positive_is_accepted():
    # p/q = inf: accepted with probability 1 (q may underflow to 0 in practice)
    p = torch.tensor([[0.2, 0.8], [1.0, 0.0]])
    q = torch.tensor([[1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        assert verify_sampling([1], p, q, gen) == (1, 0)


def test_sampling_empty_draft_samples_p0():
    p = torch.tensor([[0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    assert verify_sampling([], p, None, gen) == (0, 2)


def test_sampling_is_deterministic_given_seed():
    p = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(2, 10, generator=torch.Generator().manual_seed(2)), -1)
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(42)
        runs.append([verify_sampling([3, 7], p, q, gen) for _ in range(200)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 5


# --- verify_sampling: distribution tests --------------------------------------

# V = 6. q puts most of its mass where p has little; token 0 has p > 0 and
# q = 0, token 5 has p = 0 and q > 0.
P0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
Q0 = torch.tensor([0.00, 0.02, 0.03, 0.05, 0.30, 0.60])
P1 = torch.tensor([0.05, 0.05, 0.10, 0.40, 0.00, 0.40])
Q1 = torch.tensor([0.40, 0.00, 0.10, 0.10, 0.30, 0.10])
P2 = torch.tensor([0.10, 0.20, 0.30, 0.25, 0.15, 0.00])


def assert_distributed_as(tokens: list[int], expected: torch.Tensor) -> None:
    """Chi-square goodness of fit of ``tokens`` against ``expected`` at ALPHA;
    tokens of probability 0 must never occur."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts.tolist()}"
    n = counts.sum()
    kept = expected.double()[support]
    f_exp = kept / kept.sum() * n
    result = chisquare(counts[support].numpy(), f_exp.numpy())
    assert result.pvalue > ALPHA, f"counts {counts.tolist()} vs expected {f_exp.tolist()}: p={result.pvalue:.3g}"


def rejects(tokens: list[int], expected: torch.Tensor) -> bool:
    try:
        assert_distributed_as(tokens, expected)
    except AssertionError:
        return True
    return False


def _draw(dist: torch.Tensor, n: int, seed: int) -> list[int]:
    return torch.multinomial(dist, n, replacement=True, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def k1_outcomes():
    """TRIALS runs of verify_sampling with k = 1, drafts drawn from Q0."""
    p = torch.stack([P0, P1])  # [k + 1, V]
    q = Q0[None]  # [k, V]
    drafts = _draw(Q0, TRIALS, seed=1)
    gen = torch.Generator().manual_seed(2)
    return drafts, [verify_sampling([x], p, q, gen) for x in drafts]


def test_k1_first_token_is_distributed_as_p0(k1_outcomes):
    drafts, outcomes = k1_outcomes
    first = [drafts[i] if n >= 1 else tok for i, (n, tok) in enumerate(outcomes)]
    assert_distributed_as(first, P0)


def test_k1_acceptance_rate_is_sum_of_min_p_q(k1_outcomes):
    _, outcomes = k1_outcomes
    accepted = sum(n for n, _ in outcomes)
    expected = float(torch.minimum(P0, Q0).sum())  # 0.2
    assert binomtest(accepted, len(outcomes), expected).pvalue > ALPHA


def test_k1_bonus_after_acceptance_is_distributed_as_p1(k1_outcomes):
    _, outcomes = k1_outcomes
    bonus = [tok for n, tok in outcomes if n == 1]
    assert len(bonus) > 3000
    assert_distributed_as(bonus, P1)


def test_k1_recovered_token_is_distributed_as_residual(k1_outcomes):
    _, outcomes = k1_outcomes
    recovered = [tok for n, tok in outcomes if n == 0]
    assert_distributed_as(recovered, (P0 - Q0).clamp_min(0))


@pytest.fixture(scope="module")
def k2_outcomes():
    """TRIALS runs with k = 2: p and q differ per position, drafts drawn from q."""
    p = torch.stack([P0, P1, P2])  # [k + 1, V]
    q = torch.stack([Q0, Q1])  # [k, V]
    d0, d1 = _draw(Q0, TRIALS, seed=3), _draw(Q1, TRIALS, seed=4)
    gen = torch.Generator().manual_seed(5)
    emitted = []
    for x0, x1 in zip(d0, d1):
        n, tok = verify_sampling([x0, x1], p, q, gen)
        emitted.append([x0, x1][:n] + [tok])
    return emitted


def test_k2_first_token_is_distributed_as_p0(k2_outcomes):
    assert_distributed_as([out[0] for out in k2_outcomes], P0)


def test_k2_second_token_after_first_acceptance_is_distributed_as_p1(k2_outcomes):
    second = [out[1] for out in k2_outcomes if len(out) >= 2]
    assert len(second) > 3000
    assert_distributed_as(second, P1)


def test_k2_second_token_is_independent_of_first(k2_outcomes):
    # p1 does not depend on the first token here, so given either accepted first
    # token the second must still follow p1.
    for first in (3, 4):
        second = [out[1] for out in k2_outcomes if len(out) >= 2 and out[0] == first]
        assert len(second) > 500
        assert_distributed_as(second, P1)


def test_k2_bonus_after_full_acceptance_is_distributed_as_p2(k2_outcomes):
    bonus = [out[2] for out in k2_outcomes if len(out) == 3]
    assert len(bonus) > 1000
    assert_distributed_as(bonus, P2)


@pytest.mark.parametrize("draft", [[0, 3], [4, 5], [5, 0], [2, 4]])
def test_one_hot_q_deterministic_drafter(draft):
    # q = None: a deterministic drafter always proposing ``draft``; includes
    # draft tokens with p = 0 (5 at position 0, 4 at position 1).
    p = torch.stack([P0, P1, P2])
    gen = torch.Generator().manual_seed(6 + sum(draft))
    emitted = []
    for _ in range(TRIALS // 2):
        n, tok = verify_sampling(draft, p, None, gen)
        emitted.append(draft[:n] + [tok])
    assert_distributed_as([out[0] for out in emitted], P0)
    second = [out[1] for out in emitted if len(out) >= 2]
    if P0[draft[0]] > 0:
        assert_distributed_as(second, P1)
    else:
        assert second == []


# --- negative controls: the same test rejects wrong samplers -------------------


def test_control_sampling_from_q_is_rejected():
    assert rejects(_draw(Q0, TRIALS, seed=7), P0)


def test_control_always_accepting_the_draft_is_rejected(k1_outcomes):
    drafts, _ = k1_outcomes
    assert rejects(drafts, P0)


def _verify_with_wrong_residual(draft, p, q, generator):
    """A plausible bug: recover from p instead of norm(max(0, p - q))."""
    x = draft[0]
    if float(torch.rand(1, generator=generator)) * float(q[0, x]) < float(p[0, x]):
        return 1, int(torch.multinomial(p[1], 1, generator=generator))
    return 0, int(torch.multinomial(p[0], 1, generator=generator))


def test_control_wrong_residual_is_rejected():
    p, q = torch.stack([P0, P1]), Q0[None]
    drafts = _draw(Q0, TRIALS, seed=8)
    gen = torch.Generator().manual_seed(9)
    first = []
    for x in drafts:
        n, tok = _verify_with_wrong_residual([x], p, q, gen)
        first.append(x if n else tok)
    assert rejects(first, P0)


def test_control_small_bias_is_detected():
    # A 3-point shift of mass between two tokens is visible at this sample size.
    biased = P0.clone()
    biased[0] -= 0.03
    biased[1] += 0.03
    assert rejects(_draw(biased, TRIALS, seed=10), P0)
    assert not rejects(_draw(P0, TRIALS, seed=10), P0)
