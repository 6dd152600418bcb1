"""Drafting with a model: a smaller draft model, a quantized copy of the target,
or the target's own first layers (layer-skip self-speculation).

The drafter runs an executor (``backends.base.Executor``: the draft model's weights and
kernels, shared by every fork) and keeps one sequence on it with a KV cache of its own
(``SequenceModel``) in step with the context it is handed: before drafting it rolls back
to the longest prefix it has already seen, so rejected draft tokens are forgotten without
any feedback protocol beyond ``propose``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fastdecode.backends import make_target
from fastdecode.backends.base import BatchEntry, Executor, PagedSequence, SequenceModel
from fastdecode.backends.hf import HFTarget
from fastdecode.backends.native import NativeTarget, native_support
from fastdecode.decoding.sampling import SamplingParams, probabilities
from fastdecode.drafters.base import Draft, Drafter, DraftTarget, build_drafter, register_builder, register_drafter
from fastdecode.errors import ConfigError, IncompatibleDrafterError
from fastdecode.formats import calibrated_draft_quants, weight_format_names

if TYPE_CHECKING:
    from fastdecode.drafters.factory import DrafterOptions


def own_sequence(executor: Executor) -> SequenceModel:
    """A sequence with a cache of its own on ``executor``'s weights: a private paged cache
    on a batched executor; on the transformers one (which holds one sequence's cache
    itself, so it cannot be shared) a transformers target of its own over the same model."""
    if executor.batched:
        return PagedSequence(executor)
    return HFTarget(executor.model)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@register_drafter("draft-model")
class DraftModelDrafter(Drafter):
    """Drafts K tokens autoregressively with ``model`` (greedy, or sampled from
    its own q under the request's temperature/top-k/top-p)."""

    name = "draft-model"

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        k: int = 5,
        backend: str = "auto",
        weights: str = "float",
        executor: Executor | None = None,
    ) -> None:
        """``executor``: the draft model's executor (by default ``make_target(model, backend, weights)``)."""
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be an integer >= 1, got {k!r}")
        self.k = k
        self.tokenizer = tokenizer
        self.executor = executor if executor is not None else make_target(model, backend, weights)
        self.draft = own_sequence(self.executor)  # this drafter's sequence: what its cache holds
        self._fed: list[int] = []  # the tokens whose KV the draft cache holds
        self._shared = None  # (the engine's PagedKVCache, the request's BlockTable) when drafting in them
        self._params = SamplingParams()
        self._generator: torch.Generator | None = None
        self._vocab_size = self.draft.vocab_size
        self._target_vocab_size = self.draft.vocab_size

    def check_target(self, tokenizer, vocab_size: int) -> None:
        if self.tokenizer is not None and self.tokenizer is not tokenizer:
            mine, theirs = self.tokenizer.get_vocab(), tokenizer.get_vocab()
            if mine != theirs:
                differing = sum(1 for tok, i in theirs.items() if mine.get(tok) != i)
                raise IncompatibleDrafterError(
                    f"the draft model's vocabulary does not match the target's ({len(mine)} vs {len(theirs)} tokens, "
                    f"{differing} differ): a drafter must share the target's tokenizer"
                )
        needed = len(tokenizer) if hasattr(tokenizer, "__len__") else vocab_size
        if self.draft.vocab_size < needed:
            raise IncompatibleDrafterError(
                f"the draft model has {self.draft.vocab_size} token embeddings but the target's tokenizer "
                f"has {needed} tokens: a drafter must cover the target's vocabulary"
            )
        # Draft ids must index the target's distribution; padded rows beyond it are masked.
        self._vocab_size = min(self.draft.vocab_size, vocab_size)
        self._target_vocab_size = vocab_size

    def set_sampling(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        self._params, self._generator = params, generator

    samples_q = True  # a sampled draft comes with its q: rejection sampling

    def attach_kv(self, target, cache, table) -> bool:
        """Draft in the target's own paged cache when the draft model is the target's model
        (at another precision, ``--draft-quant``; not another model of the same shape, whose
        K and V would differ): drafting then starts from
        the target's K and V of the whole context, so there is no prefill of the prompt and
        no catching up after a step, only the draft tokens' own rows. Measured on SmolLM2
        drafting for itself from its GGUF blocks: the prompt's prefill on the draft model
        was ~0.4 s of a ~3 s request at 250 prompt tokens. Greedy output is the target's
        whatever the draft's K and V were, and the rows the drafter wrote past the context
        are overwritten by the verification pass (or by a later one, before any row reads them)."""
        ex = self.executor
        attach = isinstance(ex, NativeTarget) and target.model is ex.model and ex.reads_cache(cache)
        self._shared = (cache, table) if attach else None
        return attach

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.draft.reset()
        self._fed = []
        if self._shared is not None:
            return  # the target's prefill writes the prompt's K and V
        # The prompt's KV now, all but its last token (whose logits start the first draft): the
        # first draft then costs what later ones do, so a drafting step's time measures drafting
        # (the cost-aware K reads it), not this one-off prefill. (One logits row: transformers
        # reads 0 as "all of them".)
        head = list(prompt_ids[:-1])
        if head and len(prompt_ids) < self.draft.context_length:
            self.draft.forward(head, 1)
            self._fed = head

    def finish(self) -> None:
        self.draft.reset()  # frees its KV cache
        self._fed = []
        self._shared = None

    def fork(self) -> DraftModelDrafter:
        """The same executor (weights shared) with a sequence and KV cache of its own."""
        twin = copy.copy(self)
        twin.draft = copy.copy(self.draft)  # on the same executor, with anything set on this sequence
        twin.draft.reset()  # a cache of its own
        twin._fed, twin._generator, twin._shared = [], None, None
        return twin

    def propose(self, context: Sequence[int], k: int) -> Draft:
        k = min(k, self.draft.context_length - len(context))
        if self._shared is not None:
            cache, table = self._shared
            k = min(k, len(table.blocks) * cache.pool.block_size - len(context) + 1)  # the blocks the engine gave
        if k <= 0:
            return Draft([])
        if self._shared is not None:  # one row a token at the next position: the cache holds everything before it
            positions = iter(range(len(context) - 1, len(context) - 1 + k))

            def logits_after(feed: list[int]) -> torch.Tensor:
                return self.executor.forward_batch(cache, [BatchEntry(feed, next(positions), table.blocks, 1)])

            feed = [context[-1]]
        else:  # its own cache, rolled back to what it shares with the context
            # Keep at least the last context token unfed: its logits start the draft.
            keep = min(_common_prefix(self._fed, context), len(context) - 1)
            self.draft.truncate(keep)
            del self._fed[keep:]

            def logits_after(feed: list[int]) -> torch.Tensor:
                logits = self.draft.forward(feed, 1)
                self._fed.extend(feed)
                return logits

            feed = list(context[keep:])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(k):
            logits = logits_after(feed)[:, : self._vocab_size]  # [1, draft vocab]
            if self._params.greedy:
                token = int(logits[0].argmax())
            else:
                q = probabilities(logits, self._params)[0]
                token = int(torch.multinomial(q, 1, generator=self._generator))
                qs.append(q)
            tokens.append(token)
            feed = [token]
        q = None
        if qs:
            q = torch.stack(qs)  # [k, draft vocab]
            pad = self._target_vocab_size - q.shape[1]
            if pad > 0:
                q = torch.nn.functional.pad(q, (0, pad))
        return Draft(tokens, q)


def _draft_weights(options: DrafterOptions) -> str:
    """The draft target's weight format: int8/int4 (round-to-nearest, torch-packed) and the GGUF block formats
    run as such; "none" keeps the model's weights, and int4-gptq quantizes the model itself (``_draft_model``)."""
    return options.draft_quant if options.draft_quant in weight_format_names() else "float"


def _draft_model(options: DrafterOptions, target: DraftTarget):
    """(model, tokenizer) the drafter drafts with: the target's own, a private copy, or ``draft_model`` loaded."""
    from fastdecode.loading import load_model

    same = options.draft_model is None
    # RTN int8/int4 on the native path packs its own low-bit copy, so the
    # target's float weights can be shared. GPTQ, or low-bit on the
    # transformers path, rewrites modules in place: that needs a private copy.
    calibrated = options.draft_quant == "int4-gptq" or options.draft_quant in calibrated_draft_quants()
    private = calibrated or (options.draft_quant in ("int8", "int4") and native_support(target.model) is not None)
    if same and not private:
        return target.model, target.tokenizer
    if same:
        model, tokenizer = copy.deepcopy(target.model), target.tokenizer
    else:
        # a GGUF draft model stays in its file unless it is calibrated (GPTQ, AWQ, SmoothQuant need its float weights)
        lazy = None if not calibrated else False
        model, tokenizer = load_model(options.draft_model, dtype=target.dtype, device=target.device, lazy=lazy)
    if calibrated:  # GPTQ, AWQ, SmoothQuant: calibrated on the shipped text, the head included
        from fastdecode.quant.api import config_from_method, quantize_

        quantize_(model, config_from_method(options.draft_quant), tokenizer=tokenizer, skip=())
    return model, tokenizer


@register_builder("draft-model", reads=("draft_model", "draft_quant"), needs_target=True)
def _build_draft_model(options: DrafterOptions, target: DraftTarget) -> Drafter:
    model, tokenizer = _draft_model(options, target)
    return build_drafter("draft-model", model=model, tokenizer=tokenizer, k=options.k, weights=_draft_weights(options))


@register_drafter("layer-skip")
class LayerSkipDrafter(DraftModelDrafter):
    """Self-speculation (Draft & Verify, Zhang et al. 2023): the target drafts
    with a subset of its own layers - the first ``exit_layer`` layers (early
    exit), or all but ``skip_layers`` - then its final norm and LM head. No
    extra weights; a KV cache of its own; the model itself is not modified."""

    name = "layer-skip"

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        exit_layer: int | None = None,
        skip_layers: Sequence[int] | None = None,
        k: int = 5,
        weights: str = "float",
    ) -> None:
        reason = native_support(model)
        if reason is not None:
            raise ConfigError(f"layer-skip drafting needs the native decoder: {reason}")
        n = model.config.num_hidden_layers
        if skip_layers is not None and exit_layer is not None:
            raise ConfigError("give either exit_layer or skip_layers, not both")
        if skip_layers is not None:
            bad = [i for i in skip_layers if not 0 <= i < n]
            if bad or not skip_layers or len(set(skip_layers)) >= n:
                raise ConfigError(
                    f"skip_layers must name some but not all of the layers 0..{n - 1}, got {list(skip_layers)}"
                )
            layers = [i for i in range(n) if i not in set(skip_layers)]
        else:
            exit_layer = n // 2 if exit_layer is None else exit_layer
            if not isinstance(exit_layer, int) or not 1 <= exit_layer < n:
                raise ConfigError(f"exit_layer must be in 1..{n - 1}, got {exit_layer!r}")
            layers = list(range(exit_layer))
        self.layers = layers
        super().__init__(model, None, k=k, executor=NativeTarget(model, weights=weights, layers=layers))


def _check_layer_skip(options: DrafterOptions) -> None:
    if options.draft_model is not None or options.draft_quant not in ("none", "int8", "int4"):
        raise ConfigError(
            "layer-skip drafts with the target's own layers: it takes no --draft-model, and --draft-quant int8|int4 only"
        )


@register_builder(
    "layer-skip", reads=("draft_quant", "exit_layer", "skip_layers"), needs_target=True, check=_check_layer_skip
)
def _build_layer_skip(options: DrafterOptions, target: DraftTarget) -> Drafter:
    return build_drafter(
        "layer-skip",
        model=target.model,
        exit_layer=options.exit_layer,
        skip_layers=options.skip_layers,
        k=options.k,
        weights=_draft_weights(options),
    )


@register_drafter("hybrid")
class HybridDrafter(Drafter):
    """ANPD's n-gram memory where it has a long match, a draft model everywhere else.

    Why: the two drafters' costs and hit rates are opposite. A model drafter's tokens are
    accepted most often (the target's own GGUF blocks drafting for it in float32: ~0.95 a
    token on the built-in suite) but each costs a forward of the draft model (~8 ms on the
    2-core Zen 3, a quarter of the float32 target's step); an n-gram token costs microseconds,
    and when it continues a match of the top order (n tokens of context seen before) it is
    accepted ~0.8 of the time (docs/benchmarks.md §6d), while lower orders fall to 0.2-0.5,
    below what pays against a model token. So a step drafts the n-gram chain while its tokens
    come from matches of at least ``min_order`` (default n), and the model otherwise.

    Greedy only for the n-gram part: under sampling every draft is the model's, sampled from
    its own q (rejection sampling needs that q for every draft token). The model drafter's KV
    cache catches up with the tokens an n-gram step added in one forward at its next draft.
    """

    name = "hybrid"
    samples_q = True

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        k: int = 5,
        n: int = 5,
        min_order: int | None = None,
        backend: str = "auto",
        weights: str = "float",
        executor: Executor | None = None,
    ) -> None:
        from fastdecode.drafters.ngram import NGramDrafter

        self.ngram = NGramDrafter(n=n, k=k)
        min_order = n if min_order is None else min_order
        if not isinstance(min_order, int) or not 2 <= min_order <= n:
            raise ConfigError(f"min_order must be an n-gram order in 2..{n}, got {min_order!r}")
        self.min_order = min_order
        self.model_drafter = DraftModelDrafter(
            model, tokenizer, k=k, backend=backend, weights=weights, executor=executor
        )
        self.k = k
        self._greedy = True

    @property
    def executor(self) -> Executor:
        return self.model_drafter.executor

    @property
    def draft(self) -> SequenceModel:
        return self.model_drafter.draft

    def check_target(self, tokenizer, vocab_size: int) -> None:
        self.model_drafter.check_target(tokenizer, vocab_size)

    def set_sampling(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        self._greedy = params.greedy
        self.model_drafter.set_sampling(params, generator)

    def attach_kv(self, target, cache, table) -> bool:
        return self.model_drafter.attach_kv(target, cache, table)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.ngram.begin(prompt_ids)
        self.model_drafter.begin(prompt_ids)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._greedy:
            tokens, orders = self.ngram.mln.draft_orders(context, k)
            sure = 0
            while sure < len(tokens) and orders[sure] >= self.min_order:
                sure += 1
            if sure and sure >= k:  # (a shorter sure chain: the model's k tokens expect more)
                return Draft(tokens[:sure])
        return self.model_drafter.propose(context, k)

    def observe(self, new_tokens: Sequence[int], num_accepted: int) -> None:
        self.ngram.observe(new_tokens, num_accepted)
        self.model_drafter.observe(new_tokens, num_accepted)

    def finish(self) -> None:
        self.ngram.finish()
        self.model_drafter.finish()

    def fork(self) -> HybridDrafter:
        """The same draft model (weights shared), a KV cache and an n-gram memory of its own."""
        twin = copy.copy(self)
        twin.ngram, twin.model_drafter = self.ngram.fork(), self.model_drafter.fork()
        return twin


@register_builder("hybrid", reads=("ngram_n", "draft_model", "draft_quant"), needs_target=True)
def _build_hybrid(options: DrafterOptions, target: DraftTarget) -> Drafter:
    model, tokenizer = _draft_model(options, target)
    return build_drafter(
        "hybrid", model=model, tokenizer=tokenizer, k=options.k, n=options.ngram_n, weights=_draft_weights(options)
    )
