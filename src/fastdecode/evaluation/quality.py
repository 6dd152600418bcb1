"""Quality of the numeric model fastdecode runs: perplexity, agreement and KL against float.

The convention is the GPTQ / SparseGPT / Wanda papers': the evaluation text (by default
the WikiText-2 raw test split, ``fastdecode.data.corpora.evaluation_text``) is tokenized once and
cut into non-overlapping windows of ``window_tokens`` (2,048); each window is scored alone,
on a fresh KV cache, so its first token has no context and is not predicted. Perplexity is
``exp`` of the mean negative log-likelihood over every predicted token of every window.
(The papers drop a last partial window; here it is scored too, which moves the figure by
the tail's few tokens only.)

Terms, defined once:

- **target**: the model as fastdecode runs it (``EngineArgs.create_target``: backend, weight
  format, kernels), so ``--weights q4_0`` or a compressed directory is scored as it decodes.
- **reference**: the float model, the same spec (or ``reference``) in float32 with
  ``weights="float"``, run on the same windows.
- **top-1 agreement**: the share of predicted positions where the target's argmax token is
  the reference's.
- **KL**: mean over predicted positions of KL(reference || target) in nats,
  ``sum_v p_ref(v) * (log p_ref(v) - log p_target(v))``.

Logits are computed ``chunk_tokens`` rows at a time (a window's chunks fed in order on the
same cache), so memory holds [chunk_tokens, vocab] floats, not a window's [2048, vocab].
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from fastdecode.args import EngineArgs
from fastdecode.backends import PagedSequence, make_target
from fastdecode.errors import ConfigError

if TYPE_CHECKING:
    from fastdecode.backends.base import Executor

WINDOW_TOKENS = 2048
CHUNK_TOKENS = 256
DECODE_TOKENS = 32
EVALUATION_TEXT_NAME = "wikitext-2-raw test"


@dataclass
class QualityReport:
    """What a weights configuration costs in quality, and what it runs at."""

    model: str
    weights: str  # the target's numeric model ("float", "q4_0", "int4+float", ...)
    backend: str
    dtype: str
    text: str  # what was scored: "wikitext-2-raw test" or a file
    perplexity: float
    window_tokens: int
    stride_tokens: int
    num_windows: int
    num_tokens: int  # predicted tokens, summed over the windows
    text_tokens: int  # tokens of the whole text
    top1_agreement: float | None  # None: no float reference (see notes)
    kl: float | None  # mean KL(reference || target) per predicted token, nats
    weight_bytes: int  # bytes of weights one decode step streams (Executor.weight_bytes)
    decode_tokens_per_s: float | None  # greedy decoding through the Engine, warm-up excluded; None: not measured
    reference_model: str | None = None
    reference_weights: str | None = None
    reference_perplexity: float | None = None
    reference_weight_bytes: int | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The report as a few human-readable lines."""
        ref = ""
        if self.top1_agreement is not None and self.kl is not None:
            ref = (
                f", top-1 agreement {self.top1_agreement:.4f}, KL {self.kl:.4g} nats/token vs {self.reference_weights}"
            )
            if self.reference_perplexity is not None:
                ref += f" (reference perplexity {self.reference_perplexity:.3f})"
        speed = "-" if self.decode_tokens_per_s is None else f"{self.decode_tokens_per_s:.1f}"
        out = [
            f"{self.model} [{self.backend}, weights {self.weights}, {self.dtype}] on {self.text}: "
            f"{self.num_windows} window(s) of {self.window_tokens} tokens, stride {self.stride_tokens}, "
            f"{self.num_tokens} predicted tokens of {self.text_tokens}",
            f"perplexity {self.perplexity:.3f}{ref}",
            f"weights {self.weight_bytes / 1e6:.1f} MB, decode {speed} tok/s, {self.wall_s:.1f} s",
        ]
        return out + [f"note: {n}" for n in self.notes]


# ---------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    """Tokens ``start:end`` fed on a fresh cache; positions ``first_target .. end - 1`` are predicted
    (each from the rows before it in the window)."""

    start: int
    end: int
    first_target: int

    @property
    def num_predicted(self) -> int:
        return self.end - self.first_target


def windows(num_tokens: int, window_tokens: int, stride_tokens: int | None = None) -> list[Window]:
    """The windows over a text of ``num_tokens`` tokens.

    ``stride_tokens`` (default ``window_tokens``, the papers' non-overlapping windows) is how far
    each window starts after the last; a window predicts only positions no earlier window did, so
    with a smaller stride each window's first ``window - stride`` tokens are context only (the
    transformers "perplexity of fixed-length models" convention). A window of one token
    predicts nothing and is left out.

    Example: 10 tokens, window 4 -> [0:4] predicts 1..3, [4:8] predicts 5..7, [8:10]
    predicts 9: 3 + 3 + 1 = 7 predicted tokens. With stride 2 -> [0:4] predicts 1..3,
    [2:6] 4..5, [4:8] 6..7, [6:10] 8..9.
    """
    stride = window_tokens if stride_tokens is None else stride_tokens
    if window_tokens < 2:
        raise ConfigError(f"the window must hold at least 2 tokens, got {window_tokens}")
    if not 1 <= stride <= window_tokens:
        raise ConfigError(f"the stride must be between 1 and the window ({window_tokens}), got {stride}")
    out, scored_to, start = [], 0, 0
    while scored_to < num_tokens:
        end = min(start + window_tokens, num_tokens)
        first = max(scored_to, start + 1)
        if first < end:
            out.append(Window(start, end, first))
        scored_to, start = end, start + stride
    return out


# ---------------------------------------------------------------- scoring


@dataclass
class Scores:
    """Sums over predicted positions (float64)."""

    nll: float = 0.0
    count: int = 0
    agree: int = 0
    kl: float = 0.0
    reference_nll: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll / self.count)


def _chunks(window: Window, chunk_tokens: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk_tokens, window.end)) for a in range(window.start, window.end, chunk_tokens)]


@torch.inference_mode()
def score_window(
    target: Executor,
    ids: Sequence[int],
    window: Window,
    scores: Scores,
    reference: Executor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> None:
    """Add one window's figures to ``scores``: its tokens fed chunk by chunk on a fresh cache of
    ``target`` (and of ``reference``, compared row by row)."""
    seqs = [PagedSequence(target)] + ([PagedSequence(reference)] if reference is not None else [])
    for a, b in _chunks(window, chunk_tokens):
        # row r holds position a + r and predicts the token at a + r + 1
        lo = max(window.first_target - 1, a) - a  # first row whose prediction is scored
        hi = min(b, window.end - 1) - a  # rows up to the one predicting position end - 1
        logits = [s.forward(ids[a:b], b - a) for s in seqs]  # each [b - a, vocab]
        if hi <= lo:
            continue
        labels = torch.as_tensor(ids[a + lo + 1 : a + hi + 1], device=logits[0].device)
        logp = torch.log_softmax(logits[0][lo:hi].float(), dim=-1)  # [rows, vocab]
        scores.nll -= float(logp.gather(1, labels[:, None]).double().sum())
        scores.count += hi - lo
        if reference is not None:
            ref_logp = torch.log_softmax(logits[1][lo:hi].float().to(logp.device), dim=-1)
            scores.reference_nll -= float(ref_logp.gather(1, labels[:, None]).double().sum())
            scores.agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
            kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [rows]
            scores.kl += float(kl.double().sum())


def score_windows(
    target: Executor,
    ids: Sequence[int],
    spans: Sequence[Window],
    reference: Executor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    progress: Callable[[int, int], None] | None = None,
) -> Scores:
    """Every window of ``spans`` scored on ``target`` (and against ``reference``)."""
    scores = Scores()
    for i, window in enumerate(spans):
        score_window(target, ids, window, scores, reference, chunk_tokens)
        if progress is not None:
            progress(i + 1, len(spans))
    return scores


def tokenize(tokenizer, text: str) -> list[int]:
    """The whole text, tokenized once as the papers do (the tokenizer's special tokens included)."""
    if not text.strip():
        raise ConfigError("the evaluation text is empty")
    encode = getattr(tokenizer, "encode", None)
    if callable(encode) and hasattr(tokenizer, "model_max_length"):  # transformers: no "sequence too long" warning
        return list(tokenizer(text, verbose=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


# ---------------------------------------------------------------- decode speed


def decode_speed(engine_args: EngineArgs, model, tokenizer, target, prompt_ids: Sequence[int], tokens: int):
    """Decode tokens/s of greedy decoding of ``tokens`` new tokens from ``prompt_ids`` through the
    Engine on ``target``; a short warm-up run first is not counted. None: too few tokens to time."""
    from fastdecode.engine import GenerationConfig

    engine = engine_args.create_engine(
        GenerationConfig(max_new_tokens=tokens), model=model, tokenizer=tokenizer, target=target
    )
    engine.generate(list(prompt_ids), GenerationConfig(max_new_tokens=min(4, tokens)), chat=False)
    result = engine.generate(list(prompt_ids), chat=False)
    return result.decode_tokens_per_s if result.num_new_tokens > 1 else None


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class EvalOptions:
    """What to score and how: the text (default: the WikiText-2 raw test split), the windows,
    the float reference and the decode-speed run."""

    text: str | None = None  # None: fastdecode.data.corpora.evaluation_text()
    text_name: str | None = None  # how the report names the text (default: its source)
    window_tokens: int | None = None  # None: 2,048, or the model's context length where shorter
    stride_tokens: int | None = None  # None: the window (non-overlapping)
    max_windows: int | None = None  # None: every window of the text
    reference: str | None = None  # the float model's spec (None: the evaluated spec itself)
    compare: bool = True  # False: perplexity only, no reference model
    decode_tokens: int = DECODE_TOKENS  # 0: do not measure decode speed
    chunk_tokens: int = CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.max_windows is not None and self.max_windows < 1:
            raise ConfigError(f"max_windows must be >= 1, got {self.max_windows}")
        if self.decode_tokens < 0 or self.chunk_tokens < 1:
            raise ConfigError("decode_tokens must be >= 0 and chunk_tokens >= 1")


def _vocab(tokenizer) -> dict | None:
    return tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None


def _reference(
    engine_args: EngineArgs, model, target, spec: str | None, tokenizer=None
) -> tuple[Executor | str | None, list[str]]:
    """The float reference executor; ``"self"`` when the target is that float model already; None
    (and why, in the notes) when there is no float model to compare with."""
    from fastdecode.loading import load_model

    same_spec = spec is None or spec == engine_args.model
    kv_exact = engine_args.kv_cache_dtype in ("auto", "float32")
    if same_spec and engine_args.dtype == "float32" and target.weights == "float" and kv_exact:
        return "self", []
    if same_spec and engine_args.dtype == "float32":
        ref_model = model
    else:
        ref_model, ref_tokenizer = load_model(
            spec or engine_args.model,
            dtype="float32",
            device=engine_args.device,
            trust_remote_code=engine_args.trust_remote_code,
        )
        if tokenizer is not None and _vocab(ref_tokenizer) != _vocab(tokenizer):
            # the text is tokenized once, by the evaluated model's tokenizer: the reference must read the same ids
            raise ConfigError(
                f"the reference {spec} has another tokenizer than {engine_args.model}: compare models that share one"
            )
    reference = make_target(ref_model, engine_args.backend, "float", engine_args.float_kernel)
    if reference.vocab_size != target.vocab_size:
        raise ConfigError(f"the reference has {reference.vocab_size} logits a token, the model {target.vocab_size}")
    if reference.weights != "float":
        return None, [
            f"no float reference: {spec or engine_args.model} holds {reference.weights} layers as saved; "
            "give the original model as the reference (--reference) for agreement and KL"
        ]
    return reference, []


def _window(asked: int | None, context_length: int) -> tuple[int, list[str]]:
    """The window length: as asked (at most the context length), else 2,048 or the context length."""
    if asked is None:
        if context_length >= WINDOW_TOKENS:
            return WINDOW_TOKENS, []
        return context_length, [f"window shortened to the model's context length, {context_length} tokens"]
    if asked > context_length:
        raise ConfigError(f"a window of {asked} tokens exceeds the model's context length {context_length}")
    return asked, []


def _reference_bytes(reference, target) -> int | None:
    if reference is None:
        return None
    return target.weight_bytes() if reference == "self" else reference.weight_bytes()


def evaluate(
    engine_args: EngineArgs | str, options: EvalOptions | None = None, *, loaded=None, progress=None
) -> QualityReport:
    """Score the model ``engine_args`` describes (a spec: its defaults) as fastdecode runs it.

    ``loaded``: ``(model, tokenizer, target)`` a caller already holds (the benchmark's cache);
    ``progress(done, total)`` is called after each window."""
    from fastdecode.data import corpora

    t0 = time.perf_counter()
    args = EngineArgs(model=engine_args) if isinstance(engine_args, str) else engine_args
    opts = options or EvalOptions()
    if loaded is None:
        model, tokenizer = args.load_model()
        target = args.create_target(model, tokenizer)
    else:
        model, tokenizer, target = loaded
    text = corpora.evaluation_text() if opts.text is None else opts.text
    ids = tokenize(tokenizer, text)
    window, notes = _window(opts.window_tokens, target.context_length)
    spans = windows(len(ids), window, opts.stride_tokens)[: opts.max_windows]
    if not spans:
        raise ConfigError(f"the text is {len(ids)} token(s) long: nothing to predict")
    reference, ref_notes = _reference(args, model, target, opts.reference, tokenizer) if opts.compare else (None, [])
    scores = score_windows(
        target, ids, spans, None if reference in (None, "self") else reference, opts.chunk_tokens, progress
    )
    if reference == "self":
        agreement, kl, ref_ppl = 1.0, 0.0, scores.perplexity
    elif reference is not None:
        agreement, kl, ref_ppl = scores.agree / scores.count, scores.kl / scores.count, scores.reference_perplexity
    else:
        agreement = kl = ref_ppl = None
    speed = None
    if opts.decode_tokens > 0:
        prompt = ids[: max(1, min(64, target.context_length - opts.decode_tokens - 1))]
        speed = decode_speed(args, model, tokenizer, target, prompt, opts.decode_tokens)
    return QualityReport(
        model=args.model,
        weights=target.weights,
        backend=target.name,
        dtype=args.dtype,
        text=opts.text_name or (EVALUATION_TEXT_NAME if opts.text is None else "the given text"),
        perplexity=scores.perplexity,
        window_tokens=window,
        stride_tokens=opts.stride_tokens or window,
        num_windows=len(spans),
        num_tokens=scores.count,
        text_tokens=len(ids),
        top1_agreement=agreement,
        kl=kl,
        weight_bytes=target.weight_bytes(),
        decode_tokens_per_s=speed,
        reference_model=None if agreement is None else (opts.reference or args.model),
        reference_weights=None if agreement is None else "float",
        reference_perplexity=ref_ppl,
        reference_weight_bytes=_reference_bytes(reference, target),
        wall_s=time.perf_counter() - t0,
        notes=notes + ref_notes,
    )
