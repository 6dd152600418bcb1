"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating
Inference of Large Language Models with Token Recycling"), combined with ANPD's
n-gram memory.

Every verification pass scores each of its rows over the whole vocabulary and
then throws all but one token away. Token Recycling keeps the target's top
``width`` candidates after each input token in an **adjacency table**
(token -> its latest top candidates, overwritten on every sighting) and drafts by
walking it: after token t, propose the table's first candidate for t, then that
token's first candidate, and so on. The table belongs to the model, not to a
request, so it is shared by every request of an engine and starts warm after
the first one.

Here the walk backs off: at each draft position the n-gram memory of this
request (ANPD, orders ``n`` down to 3: a context of two or more tokens that
occurred before) speaks first, since a repeated phrase is the strongest signal;
then the adjacency table (the model's own habit after the last token); then the
n-gram bigram. Alternative paths (``propose_paths``) make a token tree: the
table's runner-up candidates at each depth of the chain, each with a short chain
of its own (``branch_k`` tokens), shallow and well-ranked ones first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastdecode.drafters.base import Draft, Drafter, DraftTarget, register_builder, register_drafter, tree_alternatives
from fastdecode.drafters.ngram import DEFAULT_MAX_CONTEXTS, MultiLevelNGram, _token_ids
from fastdecode.errors import ConfigError

if TYPE_CHECKING:
    from fastdecode.drafters.factory import DrafterOptions


class AdjacencyTable:
    """token -> the target's latest top candidates after it (most likely first).

    >>> table = AdjacencyTable(width=2)
    >>> table.update([5, 9], [[7, 8], [1, 2]])
    >>> table.next(5), table.candidates(9)
    (7, [1, 2])
    >>> table.next(3) is None
    True
    """

    def __init__(self, width: int = 8) -> None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ConfigError(f"width must be an integer >= 1, got {width!r}")
        self.width = width
        self.table: dict[int, list[int]] = {}

    def update(self, input_tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:
        for token, candidates in zip(input_tokens, topk):
            self.table[int(token)] = [int(c) for c in candidates[: self.width]]

    def next(self, token: int) -> int | None:
        candidates = self.table.get(token)
        return candidates[0] if candidates else None

    def candidates(self, token: int) -> list[int]:
        return list(self.table.get(token, ()))


@register_drafter("recycling")
class RecyclingDrafter(Drafter):
    """Token Recycling's adjacency table behind ANPD's n-gram memory (see the module doc).

    ``width``: candidates kept per token (the paper keeps 8); ``n``: the n-gram
    memory's longest order (ANPD's N); ``k``: the default draft length (K).
    """

    name = "recycling"
    cross_request_state = True  # the adjacency table: the model's candidates, from every request

    def __init__(
        self, k: int = 7, width: int = 8, n: int = 5, max_contexts: int = DEFAULT_MAX_CONTEXTS, branch_k: int = 2
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"draft length k must be an integer >= 1, got {k!r}")
        if isinstance(branch_k, bool) or not isinstance(branch_k, int) or branch_k < 0:
            raise ConfigError(f"branch_k must be an integer >= 0, got {branch_k!r}")
        self.k, self.n, self.max_contexts, self.branch_k = k, n, max_contexts, branch_k
        self.adjacency = AdjacencyTable(width)
        self.mln = MultiLevelNGram(n, max_contexts=max_contexts)  # validates n
        self.context: list[int] = []

    @property
    def topk_feedback(self) -> int:  # the engine hands observe_topk this many candidates per row
        return self.adjacency.width

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.mln = MultiLevelNGram(self.n, max_contexts=self.max_contexts)
        self.context = _token_ids(prompt_ids)
        self.mln.initialize(self.context)

    def fork(self) -> RecyclingDrafter:
        """Same settings, no request state; the adjacency table is shared (the model's, not a
        request's; the engine runs drafters on one thread, so updates never interleave)."""
        twin = RecyclingDrafter(self.k, self.adjacency.width, self.n, self.max_contexts, self.branch_k)
        twin.adjacency = self.adjacency
        return twin

    reports_sources = True

    def _next(self, tail: list[int]) -> tuple[int, str] | None:
        """The next token and its source: an n-gram of order 3+, the table, or the bigram."""
        for module in self.mln.modules[:-1]:  # orders n .. 3: two or more tokens of context matched
            prediction = module.query(tail)
            if prediction is not None:
                return prediction[0], f"{module.n}-gram"
        token = self.adjacency.next(tail[-1]) if tail else None
        if token is not None:
            return token, "table"
        prediction = self.mln.modules[-1].query(tail)  # the bigram
        return None if prediction is None else (prediction[0], "2-gram")

    def _chain(self, tail: list[int], k: int, sources: list[str] | None = None) -> list[int]:
        width = self.n - 1
        tail = tail[-width:]
        tokens: list[int] = []
        for _ in range(k):
            found = self._next(tail)
            if found is None:
                break
            tokens.append(found[0])
            if sources is not None:
                sources.append(found[1])
            tail.append(found[0])
            if len(tail) > width:
                del tail[0]
        return tokens

    def propose(self, context: Sequence[int], k: int) -> Draft:
        sources: list[str] = []
        return Draft(self._chain(_token_ids(context[-(self.n - 1) :]), k, sources), sources=tuple(sources))

    def propose_paths(self, context: Sequence[int], k: int, num_paths: int) -> Draft:
        """The chain, and a token tree around it (``tree_alternatives``): at each depth, the
        table's runner-up candidates after the token before, each with a chain of ``branch_k``."""
        tail = _token_ids(context[-(self.n - 1) :])
        sources: list[str] = []
        main = self._chain(tail, k, sources)
        if not tail:
            return Draft(main, sources=tuple(sources))

        def runners_up(d: int) -> list[int]:
            return [c for c in self.adjacency.candidates(main[d - 1] if d else tail[-1]) if c != main[d]]

        return Draft(
            main,
            alternatives=tree_alternatives(
                main, runners_up, lambda path, n: self._chain(tail + path, n), num_paths, k, self.branch_k
            ),
            sources=tuple(sources),
        )

    def observe(self, new_tokens: Sequence[int], num_accepted: int) -> None:
        new = _token_ids(new_tokens)
        self.context.extend(new)
        self.mln.update(self.context, len(new))

    def observe_topk(self, input_tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:
        self.adjacency.update(input_tokens, topk)


@register_builder("recycling", reads=("ngram_n",))
def _from_options(options: DrafterOptions, target: DraftTarget | None = None) -> RecyclingDrafter:
    """The command line's recycling drafter (``DrafterOptions``)."""
    return RecyclingDrafter(k=options.k, n=options.ngram_n)
