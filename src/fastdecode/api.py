"""The plug-and-play wrapper the ANPD paper promises: wrap a loaded model, keep calling generate."""

from __future__ import annotations

from fastdecode.backends import make_target
from fastdecode.drafters.base import build_drafter
from fastdecode.engine import Engine, GenerationConfig


def accelerate(
    model, tokenizer, /, drafter: str | None = "ngram", *, backend: str = "auto", weights: str = "float",
    float_kernel: str = "auto", kv_cache_dtype: str = "auto", max_num_seqs: int = 8, kv_cache_gb: float | None = None,
    long_prefill_token_threshold: int | None = None, **drafter_options
) -> Engine:
    """Return an :class:`Engine` whose ``generate(prompt, **options)`` decodes
    with ``drafter`` (``None`` or ``"none"`` for plain decoding).

    ``accelerate(model, tokenizer, drafter="ngram", n=5, k=7)``: drafter options
    are the drafter's own keywords (``model=`` and ``tokenizer=`` of a draft-model
    drafter included: the target's are positional); ``k`` also sets the engine's default draft
    length. ``backend``, ``weights``, ``float_kernel`` and ``kv_cache_dtype`` choose the target
    (``make_target``). ``max_num_seqs`` requests decode at once when
    ``generate`` gets a list of prompts (continuous batching, native backend);
    ``kv_cache_gb`` bounds their KV cache; ``long_prefill_token_threshold`` caps the prompt
    tokens a request takes a step while others decode (their inter-token latency).
    """
    batching = {"max_num_seqs": max_num_seqs, "kv_cache_gb": kv_cache_gb,
                "long_prefill_token_threshold": long_prefill_token_threshold}
    target = make_target(model, backend, weights, float_kernel, kv_cache_dtype)
    if drafter in (None, "none"):
        return Engine(model, tokenizer, target=target, **batching)
    built = build_drafter(drafter, **drafter_options)
    # The drafter's own K (its default when not given) is the engine's draft length.
    k = drafter_options.get("k", getattr(built, "k", None))
    config = GenerationConfig(draft_k=k) if isinstance(k, int) else None
    return Engine(model, tokenizer, drafter=built, config=config, target=target, **batching)
