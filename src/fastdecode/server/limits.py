"""Limits a server operator sets and a client cannot exceed (``fastdecode serve --max-n``,
``--max-request-tokens``, ``--max-kv-share``), so that no request can hold the server.

* **sequences** (``max_n``): ``n`` and ``best_of``, and the prompts times ``best_of``, at most
  this many; more is refused with a 400, as OpenAI refuses an ``n`` over its limit.
* **new tokens** (``max_request_tokens``, default the model's context length): ``max_tokens``
  times the request's sequences. More is clamped, as the context already clamps ``max_tokens``
  (a sequence stops there with finish_reason "length"): each sequence gets an equal share.
* **KV share** (``max_kv_share``): the KV blocks the request's sequences could hold at their
  longest (each prompt plus ``max_tokens``, within the context), at most this fraction of the
  cache: the others always keep the rest (preemption frees the newest request's blocks, never the
  oldest's, so a request that could fill the cache would hold every other one back until it ends).
  ``max_tokens`` is clamped to fit; a request whose prompts alone do not fit is refused.

A clamped request runs, and its response says so: the ``X-Fastdecode-Clamped`` header and the
response's ``fastdecode.clamped`` object (``{"max_tokens": {"requested", "granted", "limit"}}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastdecode.errors import ConfigError

DEFAULT_MAX_N = 64
DEFAULT_MAX_KV_SHARE = 0.5


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (see the module docstring)."""

    max_n: int = DEFAULT_MAX_N
    max_request_tokens: int | None = None  # None: the model's context length
    max_kv_share: float = DEFAULT_MAX_KV_SHARE

    def __post_init__(self) -> None:
        for name in ("max_n", "max_request_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        share = self.max_kv_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ConfigError(f"max_kv_share must be a number in (0, 1], got {share!r}")


@dataclass(frozen=True)
class Grant:
    """The ``max_tokens`` each sequence of a request gets, and why it is less than asked (None: it is not)."""

    max_tokens: int
    requested: int
    limit: str | None = None  # the limit that clamped it, as the operator sets it

    def clamped(self) -> dict | None:
        if self.limit is None:
            return None
        return {"max_tokens": {"requested": self.requested, "granted": self.max_tokens, "limit": self.limit}}

    def header(self) -> dict[str, str]:
        if self.limit is None:
            return {}
        return {"X-Fastdecode-Clamped": f"max_tokens={self.max_tokens}; requested={self.requested}; limit={self.limit}"}


def grant_max_tokens(
    limits: RequestLimits,
    prompt_lengths: Sequence[int],
    max_tokens: int,
    context_length: int,
    num_blocks: int | None,
    block_size: int,
) -> Grant:
    """The ``max_tokens`` each of the request's sequences gets (``prompt_lengths``: one per
    sequence) within the token cap and the KV share of ``num_blocks`` (None: no share, as where
    requests run one at a time); a ConfigError when not even one token fits.

    >>> limits = RequestLimits(max_request_tokens=100, max_kv_share=0.5)
    >>> grant_max_tokens(limits, [10, 10, 10], 1000, 128, num_blocks=64, block_size=16).max_tokens
    33
    """
    grant = Grant(max_tokens, max_tokens)
    cap = limits.max_request_tokens or context_length
    if max_tokens * len(prompt_lengths) > cap:
        flag = "--max-request-tokens" if limits.max_request_tokens else "the context length, --max-request-tokens"
        grant = Grant(cap // len(prompt_lengths), max_tokens, f"{flag} {cap}")
        if grant.max_tokens < 1:
            raise ConfigError(f"{len(prompt_lengths)} sequences are more than {flag} {cap} new tokens allow")
    if num_blocks is None:
        return grant
    share_blocks = int(limits.max_kv_share * num_blocks)

    def blocks(m: int) -> int:
        return sum(-(-min(length + m, context_length) // block_size) for length in prompt_lengths)

    if blocks(grant.max_tokens) <= share_blocks:
        return grant
    where = f"--max-kv-share {limits.max_kv_share:g} of {num_blocks} KV blocks of {block_size} positions"
    lo, hi = 0, grant.max_tokens  # the most max_tokens within the share: blocks(m) grows with m
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks(mid) <= share_blocks else (lo, mid - 1)
    if lo < 1:
        raise ConfigError(
            f"this request's {len(prompt_lengths)} sequence(s) would hold {blocks(1)} KV blocks with one new token "
            f"each, more than {where} ({share_blocks} blocks) one request may hold: send fewer or shorter prompts"
        )
    return Grant(lo, max_tokens, where)
