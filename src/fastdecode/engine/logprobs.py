"""Log-probabilities of tokens, as the OpenAI API reports them.

A generated token's log-probability comes from the target's logits at its position in the
verification pass (never a drafter's q), after the request's logits processors
(``fastdecode.decoding.logits_process``: penalties, bias, the grammar's mask) and before
temperature, top-k and top-p: the distribution greedy decoding takes its argmax of, and
the model's own log-likelihood when no processor is set (what lm-evaluation-harness
scores with). A prompt token's log-probability is the target's raw one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # the most alternatives per position (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token taken, its log-probability (None for a prompt's first token:
    nothing scores it), and the ``top`` most likely tokens there (most likely first), each
    ``(token_id, token_text, logprob)``."""

    token_id: int
    token: str
    logprob: float | None
    top: tuple[tuple[int, str, float], ...] = ()


def token_logprobs(tokenizer, logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """Row i of ``logits`` [>= len(tokens), vocab_size] scores ``tokens[i]``; each token's
    entry with its ``num_top`` most likely alternatives."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [len(tokens), vocab_size]
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    if num_top:
        top_values, top_ids = logp.topk(num_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    else:
        top_values, top_ids = [], []
    texts = _texts(tokenizer, [*tokens, *(t for row in top_ids for t in row)])
    out = []
    for i, (token, value) in enumerate(zip(tokens, chosen)):
        top = ()
        if num_top:
            top = tuple((t, texts[t], v) for t, v in zip(top_ids[i], top_values[i]))
        out.append(TokenLogprob(token, texts[token], value, top))
    return out


def first_token(tokenizer, token_id: int) -> TokenLogprob:
    """A prompt's first token, which nothing scores."""
    return TokenLogprob(token_id, _texts(tokenizer, [token_id])[token_id], None)


def _texts(tokenizer, token_ids: list[int]) -> dict[int, str]:
    """Each token's text on its own (``decode([id])``), in one call to the tokenizer for all of them."""
    distinct = list(dict.fromkeys(token_ids))
    batch_decode = getattr(tokenizer, "batch_decode", None)
    texts = batch_decode([[t] for t in distinct]) if batch_decode else [tokenizer.decode([t]) for t in distinct]
    return dict(zip(distinct, texts))
