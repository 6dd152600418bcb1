"""What the sampling tests share: the chi-square test, seeded requests decoded in batches, and a
draft policy that always drafts K (imported by name: tests/ is on sys.path via its conftest)."""

import dataclasses

import torch
from scipy.stats import chisquare

from fastdecode.engine import BatchDraftPolicy


class DraftToTheCaps(BatchDraftPolicy):
    """Every request drafts its full K at any batch size (``Engine.policy``), where the plan from
    measured pass costs would set a batch's draft lengths (a deterministic drafter's): for a test
    whose subject is verification or sampling, not whether drafting pays
    (tests/engine/test_batch_policy.py tests that plan)."""

    def plan(self, base_rows, requests, made=False, max_rows=None):
        return [cap for _, cap in requests]


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


def generate_per_seed(engine, prompt, config, seeds, batch: int = 100) -> list:
    """``engine.generate(prompt, config=...)`` once for each seed of ``seeds`` (``config.sampling``
    with that seed), in order, ``batch`` requests decoded together (``Engine.add_requests``, then
    ``step`` until they finish): the same samples in fewer passes. Each request draws from its own
    seeded generator and a row's bits do not depend on its batch, so each result is the one call
    per seed gives wherever the draft length is fixed, as when a drafter samples q (with a
    deterministic drafter at batch > 1 the cost model plans the draft length)."""
    seeds = list(seeds)
    results = []
    for start in range(0, len(seeds), batch):
        chunk = seeds[start : start + batch]
        specs = [
            dict(
                prompt=prompt, config=dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, seed=s))
            )
            for s in chunk
        ]
        ids = engine.add_requests(specs)
        finished = {}
        while len(finished) < len(ids):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.result
        results += [finished[i] for i in ids]
    return results
