"""Verification: which draft tokens the target keeps. Pure functions.

Terms are those of ``fastdecode.drafters.base``: a draft of ``k`` tokens, the
target's distribution ``p`` at each of the ``k + 1`` positions the verification
forward pass scores, the drafter's ``q`` at each of the ``k`` draft positions.
Both functions return ``(num_accepted, bonus_token)``: the accepted tokens are
``draft[:num_accepted]`` and the bonus token follows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def verify_greedy(draft: Sequence[int], target_argmax: torch.Tensor) -> tuple[int, int]:
    """Accept the longest draft prefix equal to the target's argmax.

    target_argmax: [k + 1] the target's greedy token at each position.

    >>> verify_greedy([5, 6, 7], torch.tensor([5, 6, 9, 4]))
    (2, 9)
    >>> verify_greedy([5, 6], torch.tensor([5, 6, 8]))
    (2, 8)
    """
    k = len(draft)
    if k == 0:
        return 0, int(target_argmax[0])
    drafted = torch.as_tensor(draft, dtype=target_argmax.dtype, device=target_argmax.device)
    mismatch = (drafted != target_argmax[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return n, int(target_argmax[n])


def verify_sampling(
    draft: Sequence[int],
    p: torch.Tensor,  # [k + 1, vocab_size] target probabilities
    q: torch.Tensor | None,  # [k, vocab_size] draft probabilities; None = one-hot on the draft
    generator: torch.Generator,
) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)).
    At the first rejection the recovered token is drawn from
    norm(max(0, p_i - q_i)); if all k are accepted the bonus token is drawn from
    p_k. The output is then distributed exactly as sampling from p alone.
    """
    k = len(draft)
    device = p.device
    if k:
        idx = torch.as_tensor(draft, dtype=torch.long, device=device)
        rows = torch.arange(k, device=device)
        p_x = p[rows, idx]  # [k]
        q_x = torch.ones_like(p_x) if q is None else q[rows, idx].to(p_x.dtype)
        u = torch.rand(k, generator=generator, device=device)
        # u < p/q  <=>  u * q < p, which stays defined where q underflows to 0
        rejected = (u * q_x >= p_x).nonzero()
        if rejected.numel():
            i = int(rejected[0, 0])
            if q is None:
                residual = p[i].clone()
                residual[idx[i]] = 0.0
            else:
                residual = (p[i] - q[i].to(p.dtype)).clamp_min(0.0)
            if float(residual.sum()) <= 0.0:
                # Only reachable through rounding when p_i == q_i, where rejection
                # has probability 0; p_i is then the exact residual's limit.
                residual = p[i]
            token = int(torch.multinomial(residual, 1, generator=generator))
            return i, token
    token = int(torch.multinomial(p[k], 1, generator=generator))
    return k, token


def verify_by_matching(draft: Sequence[int], target_token: Callable[[int], int]) -> tuple[int, int]:
    """Sampling against a deterministic draft (q one-hot), by matching: the target
    draws its own token at each position (``target_token(i)``, a sample from p_i)
    and the draft is accepted while it agrees.

    Lossless: every position's token is a sample from the target's p_i, as in
    plain sampling. The acceptance probability of x_i is p_i(x_i), the same as
    rejection sampling's min(1, p_i(x_i) / 1). With the draws keyed by position
    (``fastdecode.engine.request``) the tokens are exactly plain sampling's, whatever
    the draft. Draws stop at the first disagreement (which is the bonus token).

    >>> verify_by_matching([5, 6, 7], lambda i: [5, 6, 9, 4][i])
    (2, 9)
    """
    for i, x in enumerate(draft):
        t = target_token(i)
        if t != x:
            return i, t
    return len(draft), target_token(len(draft))
