"""A quick perplexity of a transformers model on a short text (one pass, no windows).

The evaluation of record is :func:`fastdecode.evaluation.quality.evaluate` (``fastdecode eval``): the
WikiText-2 raw test split in 2,048-token windows, on the target fastdecode actually runs,
with top-1 agreement and KL against the float model. This one stays for quick checks of a
module swap, where no target is built (it sits below the backends, so it cannot use them).
"""

from __future__ import annotations

import math

import torch


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, max_tokens: int = 512) -> float:
    """exp(mean next-token negative log-likelihood) over the first ``max_tokens`` tokens of ``text``."""
    ids = tokenizer(text)["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise ValueError("perplexity needs a text of at least two tokens")
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()  # [n - 1, vocab]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=device))
    return math.exp(float(nll))
