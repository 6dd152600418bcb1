"""Prompt lookup: draft by copying what followed an earlier occurrence of the
context's last few tokens (Saxena 2023, "prompt-lookup-decoding"; the method
behind transformers' ``prompt_lookup_num_tokens``).

It pays off when the output repeats its input - summaries, code edits,
question answering over a document - and costs one scan of the context per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastdecode.drafters.base import Draft, Drafter, DraftTarget, register_builder, register_drafter
from fastdecode.errors import ConfigError

if TYPE_CHECKING:
    from fastdecode.drafters.factory import DrafterOptions


def _check_ngram_sizes(max_ngram_size: int, min_ngram_size: int) -> None:
    if not isinstance(min_ngram_size, int) or min_ngram_size < 1:
        raise ConfigError(f"min_ngram_size must be an integer >= 1, got {min_ngram_size!r}")
    if not isinstance(max_ngram_size, int) or max_ngram_size < min_ngram_size:
        raise ConfigError(
            f"max_ngram_size must be an integer >= min_ngram_size ({min_ngram_size}), got {max_ngram_size!r}"
        )


def find_candidate_pred_tokens(
    context: Sequence[int],
    k: int,
    max_ngram_size: int = 2,
    min_ngram_size: int = 1,
) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the
    context's last ``ngram_size`` tokens, trying ``ngram_size`` from
    ``max_ngram_size`` down to ``min_ngram_size``; ``[]`` when nothing matches.

    An occurrence counts only if at least one token follows it, so the trailing
    n-gram never matches itself. Earliest match first, as transformers does.

    >>> context = [7, 1, 2, 3, 4, 1, 2, 5, 1, 2]
    >>> find_candidate_pred_tokens(context, k=3)  # (1, 2) first at 1, then 3 4 1
    [3, 4, 1]
    >>> find_candidate_pred_tokens([7, 1, 2, 9, 2], k=3)  # (9, 2) unseen; 2 at 2
    [9, 2]
    >>> find_candidate_pred_tokens([1, 2, 3], k=3)
    []
    """
    _check_ngram_sizes(max_ngram_size, min_ngram_size)
    if isinstance(context, list):
        ids = context  # read only; no copy of a long context per step
    elif hasattr(context, "tolist"):
        ids = context.tolist()
    else:
        ids = list(context)
    length = len(ids)
    if k <= 0:
        return []
    for ngram_size in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        ngram = ids[length - ngram_size :]
        first = ngram[0]
        # A match must start before length - ngram_size to leave a token after it.
        stop = length - ngram_size
        start = 0
        while True:
            try:
                # list.index scans in C; the full n-gram is compared only on a hit.
                start = ids.index(first, start, stop)
            except ValueError:
                break
            if ids[start : start + ngram_size] == ngram:
                end = start + ngram_size
                return ids[end : end + k]
            start += 1
    return []


@register_drafter("prompt-lookup")
class PromptLookupDrafter(Drafter):
    """Drafts with :func:`find_candidate_pred_tokens` over the whole context.

    ``k`` is the default draft length (transformers' ``prompt_lookup_num_tokens``,
    10); ``propose`` obeys the ``k`` it is handed. Stateless across steps.
    """

    name = "prompt-lookup"

    def __init__(self, k: int = 10, max_ngram_size: int = 2, min_ngram_size: int = 1) -> None:
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"draft length k must be an integer >= 1, got {k!r}")
        _check_ngram_sizes(max_ngram_size, min_ngram_size)
        self.k = k
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size

    def propose(self, context: Sequence[int], k: int) -> Draft:
        tokens = find_candidate_pred_tokens(context, k, self.max_ngram_size, self.min_ngram_size)
        return Draft(tokens=tokens, q=None)


@register_builder("prompt-lookup")
def _from_options(options: DrafterOptions, target: DraftTarget | None = None) -> PromptLookupDrafter:
    """The command line's prompt-lookup drafter (``DrafterOptions``)."""
    return PromptLookupDrafter(k=options.k)
