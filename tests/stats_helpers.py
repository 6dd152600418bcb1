"""The chi-square test the sampling tests share (imported by name: tests/ is on sys.path via its conftest)."""

import torch
from scipy.stats import chisquare


def binned_chisquare_pvalue(samples: list[int], expected: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of ``samples`` against ``expected`` probabilities,
    pooling tokens with an expected count below 5 into one bin. A sampled token the
    expected distribution rules out gives p = 0."""
    counts = torch.bincount(torch.tensor(samples), minlength=len(expected)).double()
    f_exp = expected.double() / expected.double().sum() * len(samples)
    big = f_exp >= 5
    rest_obs, rest_exp = counts[~big].sum(), f_exp[~big].sum()
    if rest_exp == 0:
        if rest_obs > 0:
            return 0.0
        obs, exp = counts[big], f_exp[big]
    else:
        obs, exp = torch.cat([counts[big], rest_obs[None]]), torch.cat([f_exp[big], rest_exp[None]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)
