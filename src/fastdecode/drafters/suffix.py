"""Suffix drafting (after SuffixDecoding: Oliaro et al. 2024, Snowflake ArcticInference).

Where the context's last tokens occurred before - earlier in this request's
prompt or output, or in an earlier request's - what followed them there is a
good guess for what follows now, and the longer the match, the better the
guess. For each draft:

1. find the occurrences of the context's last ``MIN_MATCH`` tokens in the
   request's own sequence and in the remembered earlier requests (a hash index
   of positions by their preceding tokens), and extend each match backwards,
   up to ``max_match`` tokens;
2. keep the occurrences with the longest match and count what followed them in
   a small trie (the continuations, up to ``ceil(alpha * match length)``
   tokens, at most ``k``: a short match earns a short draft);
3. the draft is the trie's most frequent path, followed while a node keeps at
   least ``min_prob`` of its parent's count (SuffixDecoding's probability gate);
   alternative paths start with the root's other children, most frequent first.

SuffixDecoding builds suffix trees; a hash index over short keys plus backward
extension gives the same longest matches for contexts of this size (thousands
of tokens) in a few lines of Python.

Memory across requests: with ``max_cached_requests > 0`` every finished
request's tokens (prompt and output) are remembered, the oldest forgotten first;
the memory is shared by the drafters an engine forks for concurrent requests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastdecode.drafters.base import Draft, Drafter, DraftTarget, register_builder, register_drafter, tree_alternatives
from fastdecode.drafters.ngram import _token_ids
from fastdecode.errors import ConfigError

if TYPE_CHECKING:
    from fastdecode.drafters.factory import DrafterOptions

MIN_MATCH = 2  # tokens of context an occurrence must share to count (the index key)
MAX_OCCURRENCES = 64  # most recent occurrences examined per document and draft


class _Document:
    """A token sequence with an index: key (MIN_MATCH tokens) -> positions that follow it."""

    __slots__ = ("tokens", "index")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, new: Sequence[int]) -> None:
        tokens = self.tokens
        for token in new:
            tokens.append(int(token))
            end = len(tokens)
            if end > MIN_MATCH:  # the key before position end - 1 (which now has a successor)
                key = tuple(tokens[end - 1 - MIN_MATCH : end - 1])
                self.index.setdefault(key, []).append(end - 1)

    def matches(self, context: Sequence[int], max_match: int, skip_end: bool) -> list[tuple[int, int]]:
        """(match length, position of the continuation) for each occurrence of the context's tail."""
        positions = self.index.get(tuple(context[-MIN_MATCH:]))
        if not positions:
            return []
        out = []
        tokens, n = self.tokens, len(context)
        for pos in positions[-MAX_OCCURRENCES:]:
            if skip_end and pos >= len(tokens):
                continue
            length = MIN_MATCH
            while (
                length < max_match
                and length < pos
                and length < n
                and tokens[pos - 1 - length] == context[n - 1 - length]
            ):
                length += 1
            out.append((length, pos))
        return out


@register_drafter("suffix")
class SuffixDrafter(Drafter):
    """SuffixDecoding-style drafting from this request's tokens and earlier requests' (see the module doc).

    ``k``: the draft length limit; ``alpha``: draft length per matched token
    (ArcticInference's ``max_spec_factor``); ``min_prob``: the probability gate;
    ``max_match``: the longest match looked for; ``max_cached_requests``: earlier
    requests remembered (0: none).
    """

    name = "suffix"
    cross_request_state = True  # the earlier requests' outputs

    def __init__(
        self, k: int = 7, alpha: float = 1.0, min_prob: float = 0.1, max_match: int = 32, max_cached_requests: int = 64
    ) -> None:
        for label, value, low in (
            ("k", k, 1),
            ("max_match", max_match, MIN_MATCH),
            ("max_cached_requests", max_cached_requests, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{label} must be an integer >= {low}, got {value!r}")
        if not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ConfigError(f"alpha must be a number > 0, got {alpha!r}")
        if not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise ConfigError(f"min_prob must lie in [0, 1], got {min_prob!r}")
        self.k, self.alpha, self.min_prob, self.max_match = k, float(alpha), float(min_prob), max_match
        self.max_cached_requests = max_cached_requests
        self.history: deque[_Document] = deque(maxlen=max_cached_requests or 1)  # shared by forks
        self.doc = _Document()

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.doc = _Document(_token_ids(prompt_ids))

    def fork(self) -> SuffixDrafter:
        twin = SuffixDrafter(self.k, self.alpha, self.min_prob, self.max_match, self.max_cached_requests)
        twin.history = self.history
        return twin

    def observe(self, new_tokens: Sequence[int], num_accepted: int) -> None:
        self.doc.extend(_token_ids(new_tokens))

    def finish(self) -> None:
        if self.max_cached_requests and len(self.doc.tokens) > MIN_MATCH:
            self.history.append(self.doc)
        self.doc = _Document()

    def _trie(self, context: Sequence[int], k: int) -> dict | None:
        """Counts of the continuations after the longest matches: nested {token: [count, children]}."""
        context = _token_ids(context[-self.max_match - 1 :])
        if len(context) < MIN_MATCH:
            return None
        found = [
            (length, doc, pos) for length, pos in self.doc.matches(context, self.max_match, True) for doc in (self.doc,)
        ]
        if self.max_cached_requests:
            for doc in self.history:
                found += [(length, doc, pos) for length, pos in doc.matches(context, self.max_match, True)]
        if not found:
            return None
        best = max(length for length, _, _ in found)
        depth = min(k, max(1, math.ceil(self.alpha * best)))
        root: dict = {}
        for length, doc, pos in found:
            if length != best:
                continue
            node = root
            for token in doc.tokens[pos : pos + depth]:
                entry = node.setdefault(token, [0, {}])
                entry[0] += 1
                node = entry[1]
        return root

    def _best_path(self, node: dict, total: int) -> list[int]:
        path = []
        while node:
            token, (count, children) = max(node.items(), key=lambda item: item[1][0])
            if count < self.min_prob * total:
                break
            path.append(token)
            node, total = children, count
        return path

    def propose(self, context: Sequence[int], k: int) -> Draft:
        root = self._trie(context, k)
        if not root:
            return Draft([])
        return Draft(self._best_path(root, sum(c for c, _ in root.values())))

    def propose_paths(self, context: Sequence[int], k: int, num_paths: int) -> Draft:
        """The best path and a token tree around it (``tree_alternatives``): at each depth,
        the other continuations the matches saw there (most frequent first), each followed
        by its own best path."""
        root = self._trie(context, k)
        if not root:
            return Draft([])
        total = sum(c for c, _ in root.values())
        main = self._best_path(root, total)
        nodes = [(root, total)]  # the trie node at each depth of main, and its count
        for token in main[:-1]:
            count, children = nodes[-1][0][token]
            nodes.append((children, count))

        def runners_up(d: int) -> list[int]:  # (through the probability gate, as the best path's tokens)
            node, count = nodes[d]
            return [
                t
                for t in sorted(node, key=lambda t: -node[t][0])
                if t != main[d] and node[t][0] >= self.min_prob * count
            ]

        def extend(path: list[int], n: int) -> list[int]:
            count, children = nodes[len(path) - 1][0][path[-1]]
            return self._best_path(children, count)[:n]

        return Draft(main, alternatives=tree_alternatives(main, runners_up, extend, num_paths, k, None))


@register_builder("suffix")
def _from_options(options: DrafterOptions, target: DraftTarget | None = None) -> SuffixDrafter:
    """The command line's suffix drafter (``DrafterOptions``)."""
    return SuffixDrafter(k=options.k)
