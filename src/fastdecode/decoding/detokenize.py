"""Incremental detokenization and stop strings, at a cost per new token that does
not grow with the length of the output.

Why: decoding all new tokens again at every step makes the t-th token cost O(t),
so a long generation is quadratic in its length; searching each stop string over
the whole text every step does the same.

Decoding a window. A tokenizer's ``decode`` is not a per-token map: a byte-level
BPE splits one multi-byte UTF-8 character over several tokens (alone, each
decodes to U+FFFD), and a SentencePiece decoder drops the leading space of
whatever token comes first. So the text of new tokens is taken as the difference
of two decodes that share a left context (HF TGI's and vLLM's technique)::

    tokens:  [ ... committed ... | prefix_offset ... read_offset | pending, new ]
    prefix_text = decode(tokens[prefix_offset:read_offset])
    window_text = decode(tokens[prefix_offset:])
    new text    = window_text[len(prefix_text):]

The new text is committed and both offsets move on (``prefix_offset`` to the old
``read_offset``, ``read_offset`` to the end) unless it is empty or ends in U+FFFD
(a character not yet complete): then it stays pending and the next call decodes a
longer window. A call decodes the previous chunk, the pending tokens and the new
ones: a few tokens, whatever the length of the output. Skipped special tokens are
dropped before decoding, as ``decode(..., skip_special_tokens=True)`` drops them,
so they neither fill the window nor separate a token from its context.

Fallbacks keep ``text`` equal to ``tokenizer.decode(new_tokens, skip_special_tokens=True)``:

* a tokenizer that declares it rewrites text across token boundaries (HF's
  ``clean_up_tokenization_spaces``: " ." -> ".", " n't" -> "n't") is decoded whole
  on every call: correct, at the old O(t) cost;
* when a window's decode does not extend its prefix's decode, text already
  committed has changed (e.g. SentencePiece byte fallback turns a run of byte
  tokens into one U+FFFD per byte once a later byte makes the run invalid UTF-8):
  that call decodes everything once. Text already released cannot be taken back,
  so there the stream and ``text`` differ; ``text`` stays exact;
* more than MAX_PENDING_TOKENS pending tokens (a model emitting invalid UTF-8, so
  the text keeps ending in U+FFFD) are committed up to the latest split whose two
  halves decode to the whole window, so stray bytes do not grow the window.

Stop strings. A stop string that appears in this call must end in the text that
this call added or changed, so it starts at most ``max(len(stop)) - 1`` characters
before it: only that tail is searched (mlx-lm's ``StopSequenceMatcher``, vLLM's
stop checker). Text that could be the start of a stop string is held back from
the stream until later tokens settle it.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete or invalid UTF-8 sequence
MAX_PENDING_TOKENS = 8  # left pending over calls before a split is tried; a character spans <= 4 byte tokens


def find_stop(text: str, stop: Sequence[str]) -> int:
    """Index in ``text`` of the earliest occurrence of any string in ``stop``, or -1.

    >>> find_stop("say hello world", ("world", "lo w"))
    7
    """
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(hits, default=-1)


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a string in ``stop``.

    >>> stop_prefix_len("hello wo", ("world", "o wor"))
    4
    """
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class IncrementalDetokenizer:
    """The text of a request's new tokens, decoded as they arrive, cut at a stop string.

    ``text`` is always ``tokenizer.decode(new_tokens, skip_special_tokens=...)``
    of the tokens added so far (cut before a stop string once one appeared).
    ``release(final)`` hands out the part of ``text`` not handed out before, for
    streaming. ``prompt_ids`` is accepted so a request can hand over its prompt,
    but it gives no decoding context: the text is that of the new tokens decoded
    alone, as ``GenerationResult.text`` has always been.

    ``min_tokens`` (vLLM's): no stop string ends in the text of the first ``min_tokens``
    tokens; one may begin there and end in a later token's text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self._num_added = 0  # tokens given to add(), special ones included (as vLLM counts for min_tokens)
        self._stop_floor = 0  # no stop string ends at or before this character (the first min_tokens tokens' text)
        self.skip_special_tokens = skip_special_tokens
        self.stop_hit = False
        self._stop_overlap = max((len(s) for s in self.stop), default=1) - 1
        # Ids that decode drops (checked on first sight: all_special_ids is only a candidate list).
        self._special_candidates = (
            frozenset(getattr(tokenizer, "all_special_ids", None) or ()) if skip_special_tokens else frozenset()
        )
        self._dropped: dict[int, bool] = {}
        # decode() rewrites across tokens: only decoding everything is exact.
        self._whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))

        self._tokens: list[int] = []  # the new tokens, skipped special tokens left out
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = ""  # decode(tokens[prefix_offset:read_offset]); None: not yet decoded
        self._split_at = MAX_PENDING_TOKENS  # pending tokens before a split is tried
        self._committed: list[str] = []  # text of tokens[:read_offset], in pieces (joined only for `text`)
        self._committed_len = 0
        self._pending = ""  # provisional text of tokens[read_offset:]; may end in U+FFFD
        self._released = 0  # characters of text handed out by release()
        self._joined: str | None = ""

    # --- adding tokens ------------------------------------------------------------

    def add(self, token_ids: Sequence[int]) -> bool:
        """Append new tokens; returns True when a stop string has appeared (text is
        then cut before it and no further text is accepted)."""
        if self.stop_hit:
            return True
        self._num_added += len(token_ids)
        new = [int(t) for t in token_ids]
        if self._special_candidates:
            new = [t for t in new if not self._is_dropped(t)]
        if not new:
            return False
        self._tokens.extend(new)
        committed_before = self._committed_len
        rewritten = self._whole or not self._decode_window(len(new))
        if rewritten:
            self._decode_whole()
        self._joined = None
        if not self.stop:
            return False
        if self._num_added <= self.min_tokens:
            self._stop_floor = self._len()
            return False
        # Committed text held no stop string, so a new one ends after it; unless
        # the decode was redone whole and may have changed any of it.
        start = 0 if rewritten else max(0, committed_before - self._stop_overlap)
        start = max(start, self._stop_floor - self._stop_overlap)
        i = find_stop(self._tail(self._len() - start), self.stop)
        if i < 0:
            return False
        self._cut(start + i)
        self.stop_hit = True
        return True

    def _is_dropped(self, token_id: int) -> bool:
        if token_id not in self._special_candidates:
            return False
        dropped = self._dropped.get(token_id)
        if dropped is None:
            dropped = self._dropped[token_id] = self._decode([token_id]) == ""
        return dropped

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _decode_window(self, num_new: int) -> bool:
        """Decode the window; False when it shows that committed text has changed."""
        tokens = self._tokens
        if self._prefix_text is None:
            self._prefix_text = self._decode(tokens[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        window_text = self._decode(tokens[self._prefix_offset :])
        if not window_text.startswith(prefix_text):
            return False
        new_text = window_text[len(prefix_text) :]
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            self._commit(new_text, len(tokens))
        elif len(tokens) - num_new - self._read_offset < self._split_at or not self._commit_split(window_text):
            self._pending = new_text  # (the split is tried only once tokens stay pending over several calls)
        return True

    def _commit_split(self, window_text: str) -> bool:
        """Commit up to the latest j whose halves decode to the whole window. Then
        the text before j is final: later tokens cannot reach back past the tail."""
        tokens, prefix_text = self._tokens, self._prefix_text
        for j in range(len(tokens) - 1, self._read_offset, -1):
            head = self._decode(tokens[self._prefix_offset : j])
            if head.startswith(prefix_text) and head + self._decode(tokens[j:]) == window_text:
                self._commit(head[len(prefix_text) :], j)
                self._pending = window_text[len(head) :]
                return True
        # No split (yet): stay correct, and try again after twice as many tokens so
        # that the attempts cost O(1) amortized per token.
        self._split_at = 2 * (len(tokens) - self._read_offset)  # pending tokens before a later call
        return False

    def _commit(self, text: str, read_offset: int) -> None:
        if text:
            self._committed.append(text)
            self._committed_len += len(text)
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._prefix_text = None
        self._pending = ""
        self._split_at = MAX_PENDING_TOKENS

    def _decode_whole(self) -> None:
        full = self._decode(self._tokens)
        self._committed, self._committed_len, self._pending = [full], len(full), ""
        # prefix_offset stays: the next window keeps its left context
        self._read_offset, self._prefix_text = len(self._tokens), None
        self._split_at = MAX_PENDING_TOKENS

    # --- reading text -------------------------------------------------------------

    @property
    def text(self) -> str:
        """All text decoded so far for the new tokens, cut before a stop string if one was hit.

        Joins the pieces (cached until the next ``add``): a stream reads ``release``.
        """
        if self._joined is None:
            self._joined = "".join(self._committed) + self._pending
        return self._joined

    def _len(self) -> int:
        return self._committed_len + len(self._pending)

    def _tail(self, n: int) -> str:
        """The last ``n`` characters of ``text``, touching only the pieces they lie in."""
        n = max(0, min(n, self._len()))
        if n <= len(self._pending):
            return self._pending[len(self._pending) - n :]
        need = n - len(self._pending)
        pieces, have = [], 0
        for piece in reversed(self._committed):
            pieces.append(piece)
            have += len(piece)
            if have >= need:
                break
        return "".join(reversed(pieces))[have - need :] + self._pending

    def _cut(self, end: int) -> None:
        text = self.text[:end]
        self._committed, self._committed_len, self._pending = [text], len(text), ""
        self._joined = text

    def release(self, final: bool) -> str:
        """The text not yet released.

        On non-final calls a trailing U+FFFD (a character still incomplete) and any
        suffix that is a proper prefix of a stop string are held back; ``final``
        releases everything, as does any call after a stop string was hit.
        """
        end = self._len()
        if not (final or self.stop_hit):
            # the unreleased text, plus enough before it to see a stop string's start
            tail = self._tail(end - self._released + self._stop_overlap)
            kept = len(tail.rstrip(REPLACEMENT_CHAR))
            kept -= stop_prefix_len(tail[:kept], self.stop)
            end -= len(tail) - kept
        if end <= self._released:
            return ""
        delta = self._tail(self._len() - self._released)[: end - self._released]
        self._released = end
        return delta
