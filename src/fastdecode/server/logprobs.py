"""Log-probabilities in OpenAI's two response formats (the engine's ``TokenLogprob`` entries in).

Completions (and vLLM's): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
one entry per token; with ``echo`` the prompt's tokens come first, the first one's
log-probability and alternatives null. ``top_logprobs`` maps token text to log-probability
and always holds the chosen token too (vLLM's convention: up to N + 1 entries).
``text_offset`` is each token's character offset in the returned text (echoed prompt
included), counted by its own decoded text, as vLLM counts it.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

JSON has no -inf: a token the request's processors forbid (a grammar, a bias of -100)
is reported as -9999.0, OpenAI's floor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fastdecode.engine.logprobs import TokenLogprob

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > FLOOR else FLOOR


class CompletionLogprobs:
    """One choice's completions-format log-probabilities, built up as its tokens arrive."""

    def __init__(self) -> None:
        self.offset = 0  # where the next token's text starts

    def skip(self, text: str) -> None:
        """Text before the next token that no entry stands for (an echoed prompt without logprobs)."""
        self.offset += len(text)

    def block(self, entries: Sequence[TokenLogprob]) -> dict:
        """The object for ``entries`` (a stream chunk's, or all of a choice's)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
            if e.logprob is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_value(e.logprob))
            top: dict[str, float] = {}
            for _, text, v in e.top:  # most likely first: two tokens that read the same keep the likelier
                top.setdefault(text, _value(v))
            top.setdefault(e.token, _value(e.logprob))
            out["top_logprobs"].append(top)
        return out


def merge(a: dict | None, b: dict) -> dict:
    """Two completions-format blocks, one after the other."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="surrogatepass"))


def chat_block(entries: Sequence[TokenLogprob]) -> dict:
    """Chat's ``logprobs`` object for ``entries``."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _value(e.logprob),
                "bytes": _bytes(e.token),
                "top_logprobs": [{"token": t, "logprob": _value(v), "bytes": _bytes(t)} for _, t, v in e.top],
            }
            for e in entries
        ]
    }
