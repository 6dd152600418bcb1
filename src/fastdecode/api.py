"""The plug-and-play wrapper the ANPD paper promises: wrap a loaded model, keep calling generate."""

from __future__ import annotations

from fastdecode.args import EngineArgs
from fastdecode.drafters.base import BUILDERS, build_drafter
from fastdecode.engine import Engine


def accelerate(
    model,
    tokenizer,
    /,
    drafter: str | None = "ngram",
    *,
    backend: str = "auto",
    weights: str = "auto",
    float_kernel: str = "auto",
    kv_cache_dtype: str = "auto",
    max_num_seqs: int = 8,
    kv_cache_gb: float | None = None,
    long_prefill_token_threshold: int | None = None,
    **drafter_options,
) -> Engine:
    """Return an :class:`Engine` whose ``generate(prompt, **options)`` decodes
    with ``drafter`` (``None`` or ``"none"`` for plain decoding).

    ``accelerate(model, tokenizer, drafter="ngram", n=5, k=7)``: drafter options
    are the drafter's own keywords (``model=`` and ``tokenizer=`` of a draft-model
    drafter included: the target's are positional); ``k`` also sets the engine's default draft
    length. ``backend``, ``weights``, ``float_kernel`` and ``kv_cache_dtype`` choose the target
    (``make_target``): ``weights="auto"`` runs a model loaded from a GGUF file (``load_model``'s
    default keeps it in its file) on the file's own blocks on the native backend, and a float model
    (a directory, ``load_model(..., lazy=False)``) as float; the engine's ``target.weights`` names
    what it took. ``max_num_seqs`` requests decode at once when
    ``generate`` gets a list of prompts (continuous batching, native backend);
    ``kv_cache_gb`` bounds their KV cache; ``long_prefill_token_threshold`` caps the prompt
    tokens a request takes a step while others decode (their inter-token latency).
    The other options are :class:`~fastdecode.args.EngineArgs`' defaults.
    """
    if weights == "auto" and _drafts_with(model, drafter, drafter_options):
        weights = "float"  # a drafter over the target's own model quantizes (or runs) its float weights
    engine_args = EngineArgs(
        backend=backend,
        weights=weights,
        float_kernel=float_kernel,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=max_num_seqs,
        kv_cache_gb=kv_cache_gb,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    target = engine_args.create_target(model, tokenizer)
    if drafter in (None, "none"):
        return engine_args.create_engine(model=model, tokenizer=tokenizer, target=target)
    built = build_drafter(drafter, **drafter_options)
    # The drafter's own K (its default when not given) is the engine's draft length.
    k = drafter_options.get("k", getattr(built, "k", None))
    if isinstance(k, int):
        engine_args.draft_k = k
    return engine_args.create_engine(model=model, tokenizer=tokenizer, target=target, drafter=built)


def _drafts_with(model, drafter: str | None, options: dict) -> bool:
    """Whether ``drafter`` drafts with ``model`` itself (layer-skip; a draft model given as, or defaulting to, the target)."""
    import fastdecode.drafters.factory  # noqa: F401  (registers the model drafters' builders)

    if drafter in (None, "none") or drafter not in BUILDERS or not BUILDERS.get(drafter).needs_target:
        return False
    return options.get("model", model) is model
