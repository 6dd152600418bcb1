"""ANPD: the adaptive N-gram drafter (Ou, Chen, Tian 2024, "Lossless Acceleration
of LLM via Adaptive N-gram Parallel Decoding").

The drafter learns, while decoding, which token tends to follow each short run of
tokens, and drafts by chaining those predictions. Terms as in the paper:

* **N-gram module** - for one order ``n``, counts of the token that followed each
  context of ``n - 1`` tokens. ``initialize`` counts every n-gram of the prompt,
  ``update`` adds the n-gram ending in one newly appended token, ``query`` gives
  the most frequent next token for a context.
* **Multi-Level N-gram (MLN)** - the modules for ``n = 2..N``. A query tries the
  longest context first (``n = N``) and falls back to shorter ones.
* **N** - the longest order; **K** - the draft length limit (paper: N=5, K=7).

Only verified tokens ever reach the counts: ``draft`` feeds its own predictions
back into a local copy of the context tail, never into the memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastdecode.drafters.base import Draft, Drafter, DraftTarget, register_builder, register_drafter, tree_alternatives
from fastdecode.errors import ConfigError

if TYPE_CHECKING:
    from fastdecode.drafters.factory import DrafterOptions

# (next token, its count, count / total for the context)
Prediction = tuple[int, int, float]

DEFAULT_MAX_CONTEXTS = 1_000_000


def _token_ids(tokens: Sequence[int]) -> list[int]:
    # Callers may hand a tensor; dict keys must be plain ints to hash by value.
    if hasattr(tokens, "tolist"):
        return tokens.tolist()
    return list(tokens)


def _check_max_contexts(max_contexts: int) -> None:
    if not isinstance(max_contexts, int) or max_contexts < 1:
        raise ConfigError(f"max_contexts must be an integer >= 1, got {max_contexts!r}")


class _Successors:
    """Next-token counts for one context, with the argmax kept up to date so a
    query costs O(1)."""

    __slots__ = ("counts", "best_token", "best_count", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.best_token = -1
        self.best_count = 0
        self.total = 0

    def add(self, token: int) -> None:
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        self.total += 1
        # Counts only grow, so comparing the one changed count keeps the argmax;
        # ">=" makes the most recently seen token win a tie.
        if count >= self.best_count:
            self.best_token = token
            self.best_count = count


class NGramModule:
    """Next-token counts for contexts of ``n - 1`` tokens.

    ``table`` may be shared between modules of different orders: their keys have
    different lengths and cannot collide, and sharing one ``OrderedDict`` makes
    the ``max_contexts`` bound and its least-recently-updated eviction global.

    >>> m = NGramModule(3)
    >>> m.initialize([1, 2, 3, 1, 2, 4, 1, 2])  # n-grams: 123 231 312 124 241 412
    >>> m.query([9, 1, 2])  # after (1, 2): 3 once, 4 once; 4 is the more recent
    (4, 1, 0.5)
    >>> m.update([1, 2], 3)
    >>> m.query([1, 2])
    (3, 2, 0.6666666666666666)
    >>> m.query([7, 7]) is None
    True
    """

    def __init__(
        self,
        n: int,
        table: OrderedDict[tuple[int, ...], _Successors] | None = None,
        max_contexts: int = DEFAULT_MAX_CONTEXTS,
    ) -> None:
        if not isinstance(n, int) or n < 2:
            raise ConfigError(f"n-gram order n must be an integer >= 2, got {n!r}")
        _check_max_contexts(max_contexts)
        self.n = n
        self.table: OrderedDict[tuple[int, ...], _Successors] = OrderedDict() if table is None else table
        self.max_contexts = max_contexts

    def initialize(self, token_ids: Sequence[int]) -> None:
        """Count every n-gram in ``token_ids``."""
        ids = _token_ids(token_ids)
        width = self.n - 1
        for i in range(width, len(ids)):
            self._add(tuple(ids[i - width : i]), ids[i])

    def update(self, context_tail: Sequence[int], token: int) -> None:
        """Count one n-gram: the last ``n - 1`` tokens of ``context_tail`` followed
        by ``token``. A shorter tail forms no n-gram and is ignored."""
        width = self.n - 1
        if len(context_tail) < width:
            return
        self._add(tuple(_token_ids(context_tail[-width:])), int(token))

    def query(self, context: Sequence[int]) -> Prediction | None:
        """The most frequent token after the last ``n - 1`` tokens of ``context``,
        as ``(token, count, probability)``; ``None`` for an unseen context."""
        width = self.n - 1
        if len(context) < width:
            return None
        successors = self.table.get(tuple(context[-width:]))
        if successors is None:
            return None
        return (
            successors.best_token,
            successors.best_count,
            successors.best_count / successors.total,
        )

    def _add(self, key: tuple[int, ...], token: int) -> None:
        table = self.table
        successors = table.get(key)
        if successors is None:
            successors = table[key] = _Successors()
            if len(table) > self.max_contexts:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        successors.add(token)


class MultiLevelNGram:
    """The MLN: N-gram modules for ``n = 2..N`` behind one longest-first query.

    A level's prediction is used only if its ``count >= min_count`` and its
    ``probability >= min_prob``; otherwise the query falls back to the next
    shorter level. The defaults (1, 0.0) gate nothing, as in the paper.

    >>> mln = MultiLevelNGram(3)
    >>> mln.initialize([5, 6, 7, 8, 6, 9])
    >>> mln.query([8, 6])  # (8, 6) was followed by 9
    (9, 1, 1.0)
    >>> mln.query([0, 6])  # (0, 6) unseen; after 6 alone: 7 then 9, 9 more recent
    (9, 1, 0.5)
    >>> mln.draft([1, 5], 4)  # 5 -> 6, (5, 6) -> 7, (6, 7) -> 8, (7, 8) -> 6
    [6, 7, 8, 6]
    """

    def __init__(
        self,
        N: int = 5,
        min_count: int = 1,
        min_prob: float = 0.0,
        max_contexts: int = DEFAULT_MAX_CONTEXTS,
    ) -> None:
        if not isinstance(N, int) or N < 2:
            raise ConfigError(f"n-gram order N must be an integer >= 2, got {N!r}")
        if not isinstance(min_count, int) or min_count < 0:
            raise ConfigError(f"min_count must be an integer >= 0, got {min_count!r}")
        if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise ConfigError(f"min_prob must lie in [0, 1], got {min_prob!r}")
        _check_max_contexts(max_contexts)
        self.N = N
        self.min_count = min_count
        self.min_prob = min_prob
        self.table: OrderedDict[tuple[int, ...], _Successors] = OrderedDict()
        # Longest order first: the order queries try them in.
        self.modules = [NGramModule(n, self.table, max_contexts) for n in range(N, 1, -1)]

    def initialize(self, prompt_ids: Sequence[int]) -> None:
        """Count every n-gram of every order in ``prompt_ids``."""
        ids = _token_ids(prompt_ids)
        for module in self.modules:
            module.initialize(ids)

    def update(self, context: Sequence[int], num_new: int) -> None:
        """Count the n-grams ending in each of the last ``num_new`` tokens of
        ``context`` (the tokens just appended to it), at every order.

        >>> mln = MultiLevelNGram(3)
        >>> mln.update([1, 2, 3], 1)  # adds (2) -> 3 and (1, 2) -> 3
        >>> mln.query([1, 2]), mln.query([2])
        ((3, 1, 1.0), (3, 1, 1.0))
        """
        if num_new <= 0:
            return
        # Only the new tokens and the N - 1 before them can form new n-grams.
        tail = _token_ids(context[-(num_new + self.N - 1) :])
        for i in range(max(len(tail) - num_new, 0), len(tail)):
            for module in self.modules:
                module.update(tail[:i], tail[i])

    def query(self, context: Sequence[int]) -> Prediction | None:
        """The prediction of the longest order whose candidate passes the gate."""
        found = self.query_order(context)
        return None if found is None else found[0]

    def query_order(self, context: Sequence[int]) -> tuple[Prediction, int] | None:
        """``query``'s prediction and the order n that made it."""
        for module in self.modules:
            prediction = module.query(context)
            if prediction is not None and prediction[1] >= self.min_count and prediction[2] >= self.min_prob:
                return prediction, module.n
        return None

    def candidates(self, context: Sequence[int], width: int) -> list[int]:
        """The ``width`` most frequent next tokens at the longest order whose best
        candidate passes the gate (most frequent first; ties: most recently seen)."""
        for module in self.modules:
            prediction = module.query(context)
            if prediction is None or prediction[1] < self.min_count or prediction[2] < self.min_prob:
                continue
            counts = module.table[tuple(context[-(module.n - 1) :])].counts
            # dicts keep insertion order, so reversed() lists later-seen tokens first among equals
            ranked = sorted(reversed(counts.items()), key=lambda item: -item[1])
            best = prediction[0]
            return [best] + [t for t, _ in ranked if t != best][: width - 1]
        return []

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens by iterating ``query``, each prediction appended to a
        local copy of the context tail; stops at the first position with none."""
        return self.draft_orders(context, k)[0]

    def draft_orders(self, context: Sequence[int], k: int) -> tuple[list[int], list[int]]:
        """``draft``'s tokens and the order that predicted each (its source)."""
        width = self.N - 1
        tail = _token_ids(context[-width:])
        tokens: list[int] = []
        orders: list[int] = []
        for _ in range(k):
            found = self.query_order(tail)
            if found is None:
                break
            token = found[0][0]
            tokens.append(token)
            orders.append(found[1])
            tail.append(token)
            if len(tail) > width:
                del tail[0]
        return tokens, orders


@register_drafter("ngram")
class NGramDrafter(Drafter):
    """ANPD's adaptive N-gram drafter.

    The memory starts from the prompt's n-grams and grows with every token
    appended to the context. With ``persistent=True`` it outlives ``begin`` and
    so carries what one request taught into the next; otherwise each request
    starts afresh. ``k`` is the paper's K, recorded for whoever builds the loop;
    ``propose`` obeys the ``k`` it is handed.
    """

    name = "ngram"

    def __init__(
        self,
        n: int = 5,
        k: int = 7,
        min_count: int = 1,
        min_prob: float = 0.0,
        persistent: bool = False,
        max_contexts: int = DEFAULT_MAX_CONTEXTS,
    ) -> None:
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"draft length k must be an integer >= 1, got {k!r}")
        self.n = n
        self.k = k
        self.min_count = min_count
        self.min_prob = min_prob
        self.persistent = persistent
        self.cross_request_state = persistent
        self.max_contexts = max_contexts
        self.mln = self._new_memory()  # validates n and the gates up front
        # The full context so far: observe() needs the tokens before each new one.
        self.context: list[int] = []

    def _new_memory(self) -> MultiLevelNGram:
        return MultiLevelNGram(self.n, self.min_count, self.min_prob, self.max_contexts)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        if not self.persistent:
            self.mln = self._new_memory()
        self.context = _token_ids(prompt_ids)
        self.mln.initialize(self.context)

    def fork(self) -> NGramDrafter:
        """Same settings, no request state. With ``persistent=True`` the memory is
        shared: every request's tokens teach every other (the engine runs drafters
        on one thread, so updates never interleave)."""
        twin = NGramDrafter(self.n, self.k, self.min_count, self.min_prob, self.persistent, self.max_contexts)
        if self.persistent:
            twin.mln = self.mln
        return twin

    reports_sources = True

    def _chain(self, context: Sequence[int], k: int) -> tuple[list[int], tuple[str, ...]]:
        """ANPD's chain and each token's source (the order that predicted it)."""
        tokens, orders = self.mln.draft_orders(context, k)
        return tokens, tuple(f"{n}-gram" for n in orders)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        tokens, sources = self._chain(context, k)
        return Draft(tokens=tokens, q=None, sources=sources)

    def propose_paths(self, context: Sequence[int], k: int, num_paths: int) -> Draft:
        """The ANPD chain, and a token tree around it (``tree_alternatives``): at each depth,
        the runner-up successors at the same level (the next most frequent tokens), each
        followed by the memory's own chain to the draft length. A width of 1 is ANPD's chain."""
        main, sources = self._chain(context, k)
        tail = _token_ids(context[-(self.n - 1) :])

        def runners_up(d: int) -> list[int]:
            return [c for c in self.mln.candidates(tail + main[:d], num_paths) if c != main[d]]

        return Draft(
            tokens=main,
            q=None,
            alternatives=tree_alternatives(
                main, runners_up, lambda path, n: self.mln.draft(tail + path, n), num_paths, k, None
            ),
            sources=sources,
        )

    def observe(self, new_tokens: Sequence[int], num_accepted: int) -> None:
        new = _token_ids(new_tokens)
        self.context.extend(new)
        self.mln.update(self.context, len(new))


@register_builder("ngram", reads=("ngram_n", "ngram_min_count", "ngram_min_prob"))
def _from_options(options: DrafterOptions, target: DraftTarget | None = None) -> NGramDrafter:
    """The command line's ngram drafter (``DrafterOptions``)."""
    return NGramDrafter(
        n=options.ngram_n, k=options.k, min_count=options.ngram_min_count, min_prob=options.ngram_min_prob
    )
