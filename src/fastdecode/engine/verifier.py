"""The target's side of a step, per request: sample its token, or accept a draft's prefix.

Terms are ``fastdecode.decoding.verify``'s: a draft's tokens are *accepted* while the target
agrees, and the target's own token after them is the *bonus* token. Every path's
accepted prefix is what plain decoding would produce (greedy, or sampling keyed by
position: ``fastdecode.engine.request.position_generator``), so whichever path is
kept, the output is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdecode.backends.base import BatchEntry
from fastdecode.decoding.logits_process import processor_for
from fastdecode.decoding.sampling import probabilities
from fastdecode.decoding.verify import verify_by_matching, verify_greedy, verify_sampling
from fastdecode.drafters.base import Draft
from fastdecode.engine.request import Request, position_generator


def sample(request: Request, logits: torch.Tensor, position: int) -> int:
    """The target's token at ``position`` from its logits [vocab_size]: argmax, or a draw
    with the position's own generator."""
    params = request.config.sampling
    if params.greedy:
        return int(logits.argmax())
    gen = position_generator(request.seed, position, logits.device)
    return int(torch.multinomial(probabilities(logits[None], params)[0], 1, generator=gen))


@dataclass
class Verdict:
    """What verification kept of one request's draft."""

    num_accepted: int  # of the kept path's tokens
    bonus: int
    tokens: list[int]  # the kept path's draft tokens
    kept: BatchEntry | None  # the alternative path's branch kept; None: the main chain
    logits: torch.Tensor  # the kept path's rows, [len(tokens) + 1, vocab_size]
    num_main_accepted: int  # of the main chain (what the draft-length policies learn from)


def verify_draft(
    request: Request, draft: Draft, logits: torch.Tensor, branches: Sequence[tuple[BatchEntry, torch.Tensor]] = ()
) -> Verdict:
    """Accept a prefix of the draft (logits: [len(draft) + 1, vocab_size]) and of each
    alternative path (its branch entry and rows in ``branches``, in ``draft.alternatives``'
    order); keep the path accepted furthest (the main chain on a tie). The request's logits
    processors apply to every row first (``fastdecode.decoding.logits_process``); the verdict's rows are
    the processed ones."""
    params = request.config.sampling
    first_position = len(request.context)
    # the request's processors, row by row, each row with its own path's history
    logits = processor_for(request, logits, draft.tokens)
    branches = [
        (branch, processor_for(request, rows, alt)) for (branch, rows), alt in zip(branches, draft.alternatives)
    ]

    def accept(tokens: list[int], rows: torch.Tensor) -> tuple[int, int]:
        if params.greedy:
            return verify_greedy(tokens, rows.argmax(dim=-1))
        return verify_by_matching(tokens, lambda i: sample(request, rows[i], first_position + i))

    if params.greedy or draft.q is None:
        n, bonus = accept(draft.tokens, logits)
    else:  # a drafter's own q: rejection sampling, from the request's one sequential stream
        n, bonus = verify_sampling(draft.tokens, probabilities(logits, params), draft.q, request.sequential_generator)
    verdict = Verdict(n, bonus, draft.tokens, None, logits, n)
    for (branch, rows), alt in zip(branches, draft.alternatives):
        alt_n, alt_bonus = accept(alt, rows)
        if alt_n > verdict.num_accepted:
            verdict = Verdict(alt_n, alt_bonus, alt, branch, rows, n)
    return verdict
