"""The drafter interface and the registry every front end builds drafters from.

Terms, defined once for the whole package (after Leviathan et al. 2023 and the
ANPD paper):

* **context** - every token id so far: the prompt followed by the tokens the
  target has produced.
* **draft** - up to ``k`` token ids a drafter proposes to follow the context.
  ``K`` is the draft length limit (ANPD's K).
* **q** - the drafter's probability distribution for each draft position,
  ``[num_draft_tokens, vocab_size]``; ``None`` for a deterministic drafter (the
  n-gram ones), which the verifier treats as one-hot on the draft token.
* **accepted** - the draft tokens the target kept, always a prefix of the draft.
* **bonus token** - the one token the target appends after the accepted prefix:
  its own choice at the first rejected position (the *recovered* token), or its
  next token when the whole draft was accepted. Every step therefore yields
  between 1 and k+1 tokens.

A drafter only proposes. Verification is a pure function (``fastdecode.decoding.verify``)
and the decode loop (``fastdecode.engine``) owns the target's KV cache; a
drafter with a cache of its own keeps it in step from the ``context`` it is
handed, and must never touch the target's state - with one exception it asks
for (``attach_kv``): the target's own model at another precision drafts in the
request's blocks past the context, which the verification pass overwrites.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from fastdecode.decoding.sampling import SamplingParams
from fastdecode.errors import ConfigError
from fastdecode.registry import Registry

if TYPE_CHECKING:
    from fastdecode.drafters.factory import DrafterOptions


@dataclass
class Draft:
    tokens: list[int]
    # [len(tokens), vocab_size] draft probabilities q, or None when deterministic
    q: torch.Tensor | None = None
    # Other candidate continuations of the same context (deterministic drafts only), verified in the
    # same forward pass as ``tokens``; the path the target accepts furthest is kept. Together they
    # are a token tree given by its root-to-leaf paths: a path's prefix shared with an earlier path
    # is computed once (``BatchEntry.shared``).
    alternatives: tuple[list[int], ...] = ()
    # Where each token of ``tokens`` came from (a label per token, e.g. "5-gram", "table"), or None.
    # Acceptance differs by source far more than by position (a 5-gram match against a bigram guess),
    # so a cost-driven draft length estimates each token's chance from its source's record.
    sources: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.sources is not None and len(self.sources) != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} tokens names {len(self.sources)} sources")

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """Proposes draft tokens for the target to verify.

    Life cycle per request: ``set_sampling(...)`` and ``begin(prompt_ids)`` once, then for each step
    ``propose(context, k)`` followed by ``observe(new_tokens, num_accepted)``
    with the tokens that were appended to the context (the accepted draft
    prefix followed by the bonus token).
    """

    name: ClassVar[str]
    # True when what the drafter learns outlives a request (its forks share one memory: earlier
    # outputs, the verifier's candidates). A benchmark then restores that memory between repeats
    # of one prompt, so that no run drafts from its own earlier output.
    cross_request_state: bool = False

    def check_target(self, tokenizer, vocab_size: int) -> None:  # noqa: B027 (an optional hook)
        """Called once per engine: raise IncompatibleDrafterError if this drafter
        cannot serve a target with this tokenizer and vocabulary size."""

    def set_sampling(self, params: SamplingParams, generator: torch.Generator | None) -> None:  # noqa: B027 (an optional hook)
        """Called before each request. A drafter that samples its draft must draw
        it from the q it returns; ``generator`` (None when greedy) is its own,
        seeded from the request's seed so runs are reproducible."""

    def attach_kv(self, target, cache, table) -> bool:
        """Offered before :meth:`begin`: the engine's target, its paged KV cache (``PagedKVCache``;
        on the transformers backend one without tensors) and this request's ``BlockTable``. A
        drafter that runs the target's own model may draft in it: the committed context's K and V are already there
        (no prefill of its own), and it writes its draft tokens' at the positions the
        verification pass then overwrites. Return True to do so; the engine then allocates
        blocks for the positions up to ``len(context) + k`` before each :meth:`propose`."""
        return False

    def begin(self, prompt_ids: Sequence[int]) -> None:  # noqa: B027 (an optional hook)
        """Start a request whose context is ``prompt_ids``."""

    @abstractmethod
    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Propose at most ``k`` tokens to follow ``context`` (may be fewer, or none)."""

    def propose_paths(self, context: Sequence[int], k: int, num_paths: int) -> Draft:
        """Like :meth:`propose`, plus up to ``num_paths - 1`` alternative paths of at most
        ``k`` tokens each in ``Draft.alternatives`` (a drafter with one guess proposes one)."""
        return self.propose(context, k)

    def observe(self, new_tokens: Sequence[int], num_accepted: int) -> None:  # noqa: B027 (an optional hook)
        """Feedback after verification: ``new_tokens`` were appended to the context,
        the first ``num_accepted`` of them being accepted draft tokens."""

    #: candidates per row the drafter wants from the target's verification logits (0: none).
    topk_feedback: ClassVar[int] = 0

    def observe_topk(self, input_tokens: Sequence[int], topk: Sequence[Sequence[int]]) -> None:  # noqa: B027 (an optional hook)
        """After a pass (when ``topk_feedback`` > 0): ``topk[i]`` are the target's
        ``topk_feedback`` most likely tokens after ``input_tokens[i]``, most likely first,
        for the rows whose inputs were committed (the last context token and the accepted
        draft)."""

    def finish(self) -> None:  # noqa: B027 (an optional hook)
        """The request ended: free what it held (a draft model's KV cache)."""

    def fork(self) -> Drafter:
        """A drafter with the same settings and no request state, for another request
        running at the same time (the engine keeps one drafter per running request).
        Shares what is read-only (a draft model's weights). The default deep-copies."""
        import copy

        return copy.deepcopy(self)

    #: whether sampled drafts come with a q of their own (rejection sampling against it).
    samples_q: ClassVar[bool] = False

    #: whether drafts name each token's source (``Draft.sources``): a cost-driven draft length
    #: then drafts up to its cap and cuts the draft where its sources' acceptance stops paying.
    reports_sources: ClassVar[bool] = False


def tree_alternatives(
    main: list[int],
    runners_up: Callable[[int], list[int]],
    extend: Callable[[list[int], int], list[int]],
    num_paths: int,
    k: int,
    branch_k: int | None,
) -> tuple[list[int], ...]:
    """Up to ``num_paths - 1`` alternative paths making a token tree around the chain ``main``:
    at each depth d, ``runners_up(d)`` (ranked tokens other than main[d] that may follow
    main[:d]), each followed by ``extend(path, n)``, at most n = min(branch_k, k - d - 1)
    tokens (``branch_k`` None: the rest of k). Branches are taken in the order of a geometric
    guess at their worth, P(the chain reaches depth d) x P(the r-th candidate is the one)
    ~ 2^-(d + r) (r = 2 for the best runner-up): shallow, well-ranked ones first. The engine
    verifies each node of the tree once and drops what does not fit or pay."""
    if num_paths <= 1 or not main:
        return ()
    branches = []  # (d + r, d, token)
    for d in range(len(main)):
        branches.extend((d + r, d, c) for r, c in enumerate(runners_up(d)[: num_paths - 1], start=2))
    alternatives = []
    for _, d, first in sorted(branches)[: num_paths - 1]:
        path = [*main[:d], first]
        rest = k - d - 1 if branch_k is None else min(branch_k, k - d - 1)
        alternatives.append(path + extend(path, rest) if rest > 0 else path)
    return tuple(alternatives)


DrafterFactory = Callable[..., Drafter]
DRAFTERS: Registry = Registry("drafter")


def register_drafter(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Class or function decorator: make a drafter buildable by name."""
    return DRAFTERS.register(name)


def available_drafters() -> list[str]:
    return DRAFTERS.names()


def build_drafter(name: str, **options) -> Drafter:
    """Build a registered drafter; options are the drafter's own keyword arguments
    (an unknown one is an error naming it, never a TypeError)."""
    import inspect

    factory = DRAFTERS.get(name)
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            allowed = ", ".join(p for p in params if p != "self") or "none"
            raise ConfigError(f"unknown option(s) for the {name} drafter: {', '.join(unknown)} (it takes: {allowed})")
    return factory(**options)


# ---------------------------------------------------------------- building a drafter from the shared settings


@dataclass(frozen=True)
class DraftTarget:
    """What a drafter that drafts with a model gets of the target: its model and tokenizer, and the
    dtype and device a draft model of its own loads in."""

    model: Any
    tokenizer: Any
    dtype: str = "float32"
    device: str = "cpu"


@dataclass(frozen=True)
class DrafterBuilder:
    """How the command line builds one drafter from the shared drafter settings
    (``fastdecode.drafters.factory.DrafterOptions``: K and the ``--ngram-*``, ``--draft-*``,
    ``--exit-layer`` ... flags). ``reads`` names the settings besides K it reads: a flag for
    one it does not read is an error, not ignored. ``check`` refuses settings it cannot take,
    before any model loads."""

    build: Callable[[DrafterOptions, DraftTarget | None], Drafter]
    reads: tuple[str, ...] = ()
    needs_target: bool = False  # drafts with the target's model (build gets a DraftTarget)
    check: Callable[[DrafterOptions], None] | None = None


BUILDERS: Registry[str, DrafterBuilder] = Registry("drafter builder")


def register_builder(
    name: str,
    *,
    reads: Sequence[str] = (),
    needs_target: bool = False,
    check: Callable[[DrafterOptions], None] | None = None,
):
    """Function decorator, beside the drafter it builds: ``build(options, target)`` makes drafter
    ``name`` from the shared settings (``target``: a DraftTarget when ``needs_target``, else None)."""

    def add(build):
        BUILDERS.register(name)(DrafterBuilder(build, tuple(reads), needs_target, check))
        return build

    return add


def readers(setting: str) -> list[str]:
    """The drafters whose builder reads ``setting``: those that need only their settings first, then
    those that draft with a model, each by name."""
    names = [name for name in BUILDERS.names() if setting in BUILDERS.get(name).reads]
    return sorted(names, key=lambda name: (BUILDERS.get(name).needs_target, name))
