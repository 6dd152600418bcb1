"""Distil a shallow drafter from a target that has none (DistillSpec, Zhou et al. 2023).

Terms as in ``fastdecode.drafters.base``; here **p** is the target's
next-token distribution and **q** the drafter's.

The drafter is a few of the target's own decoder layers between copies of its
embeddings, final norm and LM head, so it shares the target's tokenizer by
construction. Untrained it drafts almost nothing the target accepts: a few of
thirty layers do not compute what thirty do. Training minimises the forward
KL(p || q) at every position of sequences the target itself wrote (its greedy
continuations of prompts), DistillSpec's recipe for greedy speculative
decoding: on-policy data and a divergence on the full distribution, not only
on the target's argmax.

Flow: build_shallow_drafter -> target_sequences (the Engine, greedy) ->
teacher_top_logprobs (p's top-k, once per sequence) -> train (AdamW, the
layers and final norm; embeddings and LM head frozen) -> save -> acceptance on
held-out prompts before and after, the after figures with the saved copy
loaded back, so the figures describe the files on disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from fastdecode.errors import ConfigError

REPORT_FILE = "fastdecode_distill.json"

@dataclass(frozen=True)
class DistillSettings:
    num_layers: int = 4
    layer_indices: tuple[int, ...] | None = None  # overrides num_layers
    steps: int = 300  # optimizer steps (fewer when max_minutes runs out first)
    lr: float = 3e-4
    batch_size: int = 2  # sequences per step
    seq_len: int = 256  # tokens per training sequence: the last seq_len of prompt + continuation
    num_prompts: int = 48  # training prompts (held-out prompts come on top)
    new_tokens: int = 96  # greedy target tokens generated per training prompt
    max_minutes: float = 10.0  # budget for the training loop alone (data and evaluation come on top)
    draft_k: int = 5  # K when measuring acceptance
    eval_new_tokens: int = 64  # tokens generated per held-out prompt when measuring acceptance
    top_k_logprobs: int = 64  # p is kept as its top-k log-probabilities per position
    seed: int = 0

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")

        for name, low in [("num_layers", 1), ("steps", 1), ("batch_size", 1), ("seq_len", 2), ("num_prompts", 1),
                          ("new_tokens", 1), ("draft_k", 1), ("eval_new_tokens", 1), ("top_k_logprobs", 1), ("seed", 0)]:
            integer(name, low)
        for name in ("lr", "max_minutes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if self.layer_indices is not None:
            indices = tuple(self.layer_indices)
            if not indices or any(isinstance(i, bool) or not isinstance(i, int) for i in indices):
                raise ConfigError(f"layer_indices must be a non-empty list of integers, got {self.layer_indices!r}")
            object.__setattr__(self, "layer_indices", indices)


@dataclass
class AcceptanceFigures:
    """A drafter measured against the target on held-out prompts (greedy, K = draft_k)."""

    alpha: float  # accepted / drafted tokens, over all prompts
    tau: float  # tokens per verification step, counting the bonus token
    kl_nats_per_token: float  # mean KL(p || q) over the positions of the held-out sequences
    steps: int
    drafted_tokens: int
    accepted_tokens: int
    lossless: bool  # speculative output == plain greedy output on every prompt


@dataclass
class DistillReport:
    out_dir: str
    target: str  # the spec the target was loaded from, as given
    layer_indices: list[int]  # the target's layers the drafter took, in order
    settings: DistillSettings
    before: AcceptanceFigures
    after: AcceptanceFigures
    num_train_sequences: int
    num_train_tokens: int
    num_heldout_prompts: int
    train_steps: int  # steps done (fewer than settings.steps when the budget ran out)
    train_loss_first: float  # truncated_kl on the first / last step's batch, nats per token
    train_loss_last: float
    data_s: float  # generating the target's sequences and its top-k log-probabilities
    train_s: float
    eval_s: float
    trainable_params: int
    losses: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("losses")
        return out


# ---------------------------------------------------------------- building


def default_layer_indices(num_target_layers: int, num_layers: int) -> list[int]:
    """Evenly spread over the target, first and last included: round(linspace(0, n - 1, L)).

    Why spread rather than the first L: untrained, no choice of 4 of
    SmolLM2-135M's 30 layers drafts anything worth having (greedy acceptance
    0.00 for [0, 10, 19, 29] and 0.01 for [0, 1, 2, 3] on 3 held-out suite
    prompts, K = 5), so what matters is where training starts. By the training
    objective, KL(p || q) on the first 200 tokens of 4 held-out suite prompts,
    the spread layers start closest to the target: 12.2 nats/token, against
    14.9 for the first four (which do agree with p's argmax more often, 5.8%
    against 0%), 15.9 for five spread layers, 17.2 for [0, 15, 28, 29], 18.7
    for [0, 1, 28, 29] and 26.2 for [0, 1, 2, 29]. The last layer maps the
    residual stream into what the final norm and LM head read; spread layers
    leave the least of the target's computation missing between them.
    """
    if num_layers == 1:
        return [num_target_layers - 1]
    return sorted({round(i * (num_target_layers - 1) / (num_layers - 1)) for i in range(num_layers)})


def _check_layers(num_target_layers: int, num_layers: int, layer_indices: Sequence[int] | None) -> list[int]:
    if layer_indices is None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < num_target_layers:
            raise ConfigError(
                f"a drafter takes 1..{num_target_layers - 1} of the target's {num_target_layers} layers, got {num_layers!r}"
            )
        return default_layer_indices(num_target_layers, num_layers)
    layers = list(layer_indices)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_target_layers]
    if not layers or bad or len(set(layers)) != len(layers) or len(layers) >= num_target_layers:
        raise ConfigError(
            f"layer indices must be 1..{num_target_layers - 1} distinct layers of 0..{num_target_layers - 1}, got {layers}"
        )
    return layers


_LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")


def build_shallow_drafter(target_model, num_layers: int = 4, layer_indices: Sequence[int] | None = None):
    """A new model of the target's class: its embeddings, ``layer_indices`` of
    its decoder layers (in that order; default ``default_layer_indices``), its
    final norm and LM head, tied where the target ties them.

    The weights are copied, so training the drafter leaves the target as it is,
    and the target's config is never modified (the drafter gets a deep copy).
    The copy drops ``quantization_config``: a model loaded from GGUF carries a
    GGUF quantizer that ``save_pretrained`` refuses, but its weights are plain
    dequantized tensors, so the drafter is an ordinary model that saves normally.
    """
    import copy

    config = copy.deepcopy(target_model.config)
    n = config.num_hidden_layers
    layers = _check_layers(n, num_layers, layer_indices)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.num_hidden_layers = len(layers)
    # Per-layer settings (e.g. Gemma 3's sliding/full attention pattern) follow their layers.
    if isinstance(getattr(config, "layer_types", None), (list, tuple)) and len(config.layer_types) == n:
        config.layer_types = [config.layer_types[i] for i in layers]
    source = target_model.state_dict()
    param = next(target_model.parameters())
    with torch.device(param.device):
        drafter = type(target_model)(config)
    drafter.to(param.dtype)
    position = {j: i for j, i in enumerate(layers)}  # drafter layer j <- target layer i

    def source_key(key: str) -> str:
        return _LAYER_KEY.sub(lambda m: f"{m.group(1)}layers.{position[int(m.group(2))]}.", key, count=1)

    state = {key: source[source_key(key)] for key in drafter.state_dict()}
    # load_state_dict copies into the drafter's own tensors: no storage is shared.
    drafter.load_state_dict(state, strict=True)
    drafter.generation_config = copy.deepcopy(target_model.generation_config)
    drafter.config.fastdecode_layer_indices = list(layers)  # provenance, saved in config.json
    return drafter.eval()


# ---------------------------------------------------------------- data


def default_prompts(num_train: int) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts) from the built-in suite.

    Held out: the last prompt of each category, never seen in training in any
    form. Training: the other suite prompts, then instructions over ~300-character
    chunks of their text (the calibration text minus the held-out prompts, so
    nothing held out leaks in), cycling through a few instruction kinds.
    """
    from fastdecode.suite import builtin_suite

    suite = builtin_suite()
    last = {s.category: i for i, s in enumerate(suite)}
    heldout = [suite[i].prompt for i in sorted(last.values())]
    train_suite = [s.prompt for i, s in enumerate(suite) if i not in set(last.values())]
    chunks: list[str] = []
    for text in train_suite:
        words, chunk = text.split(), []
        for w in words:
            chunk.append(w)
            if sum(len(x) + 1 for x in chunk) >= 300:
                chunks.append(" ".join(chunk))
                chunk = []
        if len(chunk) >= 8:
            chunks.append(" ".join(chunk))
    kinds = [
        "Continue this text:\n\n{}",
        "Summarize this in two sentences:\n\n{}",
        "Explain the following to a beginner:\n\n{}",
        "Write three questions about this passage, then answer them:\n\n{}",
        "Rewrite this in simpler words:\n\n{}",
    ]
    train = list(train_suite)
    # Round r asks about chunk c in the (c + r)-th way: every chunk, every way, no pair twice.
    for i in range(len(chunks) * len(kinds)):
        if len(train) >= num_train:
            break
        r, c = divmod(i, len(chunks))
        train.append(kinds[(c + r) % len(kinds)].format(chunks[c]))
    return train[:num_train], heldout


def target_sequences(engine, prompts: Sequence, new_tokens: int, progress=None, task=None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) for each prompt: text
    (chat-templated where the tokenizer has a template, as ``Engine.encode``
    does) or token ids. A prompt too long to leave room for ``new_tokens`` in
    the target's context keeps its last tokens."""
    out = []
    room = max(1, engine.target.context_length - new_tokens)
    for prompt in prompts:
        ids = engine.encode(prompt)[-room:]
        result = engine.generate(ids, max_new_tokens=new_tokens)
        out.append((ids, list(result.token_ids)))
        if progress is not None:
            progress.advance(task)
    return out


@torch.no_grad()
def teacher_top_logprobs(target_model, ids: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p's ``top_k`` largest values and their token ids at every position of ``ids`` [T]:
    two tensors [T, top_k] (float32, int64)."""
    logits = target_model(input_ids=ids[None], use_cache=False).logits[0].float()  # [T, vocab]
    log_p = F.log_softmax(logits, dim=-1)
    values, indices = log_p.topk(min(top_k, log_p.shape[-1]), dim=-1)
    return values, indices


def truncated_kl(drafter_logits: torch.Tensor, top_log_p: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """KL(p || q) with both distributions coarsened to p's top-k tokens plus one
    bucket for all the others, per position.

    drafter_logits [..., vocab]; top_log_p, top_ids [..., k] -> [...]. With k
    the whole vocabulary this is KL(p || q) exactly; with fewer it is a true
    divergence (>= 0) that never exceeds it, and the tail bucket still pushes
    q's mass off the tokens p finds unlikely.
    """
    logits = drafter_logits.float()
    log_norm = logits.logsumexp(-1)  # [...]
    log_q = logits.gather(-1, top_ids) - log_norm[..., None]
    kl = (top_log_p.exp() * (top_log_p - log_q)).sum(-1)
    if top_ids.shape[-1] < logits.shape[-1]:
        log_q_tail = logits.scatter(-1, top_ids, float("-inf")).logsumexp(-1) - log_norm
        p_tail = (1.0 - top_log_p.exp().sum(-1)).clamp_min(1e-12)
        kl = kl + p_tail * (p_tail.log() - log_q_tail)
    return kl


@torch.no_grad()
def kl_per_token(target_model, drafter, sequences: Sequence[Sequence[int]]) -> float:
    """Mean KL(p || q) in nats over every position of ``sequences`` (full vocabulary)."""
    total, count = 0.0, 0
    device = next(drafter.parameters()).device
    for seq in sequences:
        ids = torch.tensor([list(seq)], dtype=torch.long, device=device)
        log_p = F.log_softmax(target_model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)  # [T, vocab]
        log_q = F.log_softmax(drafter(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
        vocab = min(log_p.shape[-1], log_q.shape[-1])
        log_p, log_q = log_p[:, :vocab], log_q[:, :vocab]
        total += float((log_p.exp() * (log_p - log_q)).sum())
        count += ids.shape[1]
    return total / count


# ---------------------------------------------------------------- training


def trainable_parameters(drafter) -> list[torch.nn.Parameter]:
    """Every parameter but the embeddings and LM head: those are the target's
    (the largest tensors of a small model, 28M of SmolLM2's parameters), and
    keeping them frozen keeps the drafter's token space the target's."""
    frozen = {id(drafter.get_input_embeddings().weight)}
    if drafter.get_output_embeddings() is not None:
        frozen.add(id(drafter.get_output_embeddings().weight))
    return [p for p in drafter.parameters() if id(p) not in frozen]


def train(drafter, examples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], settings: DistillSettings,
          progress=None) -> tuple[list[float], float]:
    """Minimise the coarsened KL(p || q) (``truncated_kl``) over ``examples`` (ids [T], top log p [T, k],
    top ids [T, k]) with AdamW on every parameter but the embeddings and LM head.

    Returns (the loss of each step, seconds spent). Stops after ``settings.steps``
    or when ``settings.max_minutes`` has passed, whichever comes first. Leaves
    the drafter in eval mode with every parameter trainable again.
    """
    params = trainable_parameters(drafter)
    chosen = {id(p) for p in params}
    for p in drafter.parameters():
        p.requires_grad_(id(p) in chosen)
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    warmup = max(1, min(20, settings.steps // 10))

    def lr_scale(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, settings.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)
    generator = torch.Generator().manual_seed(settings.seed)
    device = next(drafter.parameters()).device
    order: list[int] = []
    losses: list[float] = []
    task = progress.add_task("training", total=settings.steps, note="") if progress is not None else None
    drafter.train()
    t0 = time.perf_counter()
    deadline = t0 + settings.max_minutes * 60
    try:
        for _ in range(settings.steps):
            if time.perf_counter() > deadline:
                break
            batch = []
            for _ in range(min(settings.batch_size, len(examples))):
                if not order:
                    order = torch.randperm(len(examples), generator=generator).tolist()
                batch.append(examples[order.pop()])
            length = max(ids.shape[0] for ids, _, _ in batch)
            k = batch[0][1].shape[1]
            ids = torch.zeros(len(batch), length, dtype=torch.long)
            top_log_p = torch.zeros(len(batch), length, k)
            top_ids = torch.zeros(len(batch), length, k, dtype=torch.long)
            mask = torch.zeros(len(batch), length)
            # Right padding: causal attention keeps pads from reaching real positions; the mask drops theirs.
            for b, (seq, lp, li) in enumerate(batch):
                n = seq.shape[0]
                ids[b, :n], top_log_p[b, :n], top_ids[b, :n], mask[b, :n] = seq, lp, li, 1.0
            ids, top_log_p, top_ids, mask = (t.to(device) for t in (ids, top_log_p, top_ids, mask))
            logits = drafter(input_ids=ids, use_cache=False).logits  # [B, T, vocab]
            loss = (truncated_kl(logits, top_log_p, top_ids) * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if progress is not None:
                progress.update(task, advance=1, note=f"KL {losses[-1]:.3f}")
    finally:
        drafter.eval()
        for p in drafter.parameters():
            p.requires_grad_(True)
    return losses, time.perf_counter() - t0


# ---------------------------------------------------------------- measuring


def measure_acceptance(target_model, tokenizer, drafter_model, prompt_ids: Sequence[list[int]],
                       plain_outputs: Sequence[list[int]], settings: DistillSettings, target=None,
                       progress=None, description: str = "acceptance") -> AcceptanceFigures:
    """Greedy speculative decoding of each held-out prompt with ``drafter_model``
    drafting K = ``settings.draft_k``; ``plain_outputs`` are the target's plain
    greedy outputs, to check losslessness and to score KL on."""
    from fastdecode.drafters import build_drafter
    from fastdecode.engine import Engine

    steps = drafted = accepted = step_tokens = 0
    lossless = True
    task = progress.add_task(description, total=len(prompt_ids), note="") if progress is not None else None
    for ids, plain in zip(prompt_ids, plain_outputs):
        drafter = build_drafter("draft-model", model=drafter_model, tokenizer=tokenizer, k=settings.draft_k)
        engine = Engine(target_model, tokenizer, drafter=drafter, target=target)
        result = engine.generate(ids, max_new_tokens=settings.eval_new_tokens, draft_k=settings.draft_k)
        lossless &= list(result.token_ids) == list(plain)
        a = result.acceptance
        steps, drafted, accepted, step_tokens = steps + a.steps, drafted + a.drafted_tokens, accepted + a.accepted_tokens, step_tokens + a.step_tokens
        if progress is not None:
            progress.advance(task)
    kl = kl_per_token(target_model, drafter_model, [list(ids) + list(plain) for ids, plain in zip(prompt_ids, plain_outputs)])
    return AcceptanceFigures(
        alpha=accepted / drafted if drafted else 0.0, tau=step_tokens / steps if steps else 0.0, kl_nats_per_token=kl,
        steps=steps, drafted_tokens=drafted, accepted_tokens=accepted, lossless=lossless,
    )


# ---------------------------------------------------------------- the whole recipe


def _prepare_out_dir(out_dir) -> Path:
    """A new or empty directory, or an earlier distill output (never overwrite someone's files).
    Checked before any work; created only when the output is complete."""
    from fastdecode._cli_util import check_output_dir

    return check_output_dir(out_dir, "drafter", allow_nonempty_if=lambda p: (p / REPORT_FILE).is_file())


def save_drafter(drafter, tokenizer, out_dir) -> None:
    from fastdecode.loading import _quiet

    with _quiet():
        drafter.save_pretrained(out_dir)  # safetensors
        tokenizer.save_pretrained(out_dir)


def distill_drafter(target_model, tokenizer, out_dir, settings: DistillSettings | None = None, progress: bool = True,
                    *, target_spec: str = "", train_prompts: Sequence | None = None,
                    heldout_prompts: Sequence | None = None) -> DistillReport:
    """Build a shallow drafter from ``target_model``, distil it on the target's
    own greedy outputs, save it to ``out_dir`` (a Hugging Face model directory
    that ``load_model`` and ``--draft-model`` take) and report its acceptance
    on held-out prompts before and after training.

    ``train_prompts`` / ``heldout_prompts`` (text or token ids) default to
    ``default_prompts(settings.num_prompts)``; given, they are used as they are.
    """
    from fastdecode._cli_util import staged_dir
    from fastdecode.backends import make_target
    from fastdecode.engine import Engine
    from fastdecode.loading import load_model

    settings = settings or DistillSettings()
    layers = _check_layers(target_model.config.num_hidden_layers, settings.num_layers, settings.layer_indices)
    path = _prepare_out_dir(out_dir)
    if train_prompts is None or heldout_prompts is None:
        default_train, default_heldout = default_prompts(settings.num_prompts)
        train_prompts = default_train if train_prompts is None else train_prompts
        heldout_prompts = default_heldout if heldout_prompts is None else heldout_prompts
    if not train_prompts or not heldout_prompts:
        raise ConfigError("distillation needs at least one training and one held-out prompt")
    torch.manual_seed(settings.seed)
    target_model.eval()
    target = make_target(target_model)
    engine = Engine(target_model, tokenizer, target=target)

    # Everything is written into a staging directory and moved into ``path`` at the end, the
    # report last: an error or Ctrl-C leaves no half-written drafter.
    with _progress(progress) as bar, staged_dir(path, marker=REPORT_FILE) as staging:
        t0 = time.perf_counter()
        task = bar.add_task("target outputs", total=len(train_prompts) + len(heldout_prompts), note="") if bar is not None else None
        train_seqs = target_sequences(engine, train_prompts, settings.new_tokens, bar, task)
        heldout = target_sequences(engine, heldout_prompts, settings.eval_new_tokens, bar, task)
        device = next(target_model.parameters()).device
        examples = []
        task = bar.add_task("target top-k log p", total=len(train_seqs), note="") if bar is not None else None
        for ids, new in train_seqs:
            seq = torch.tensor((ids + new)[-settings.seq_len :], dtype=torch.long, device=device)
            top_log_p, top_ids = teacher_top_logprobs(target_model, seq, settings.top_k_logprobs)
            examples.append((seq.cpu(), top_log_p.cpu(), top_ids.cpu()))
            if bar is not None:
                bar.advance(task)
        data_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        heldout_ids = [ids for ids, _ in heldout]
        heldout_plain = [new for _, new in heldout]
        # A fresh copy for the before figures: the draft-model drafter's native
        # decoder re-points a model's projections at fused copies, which must
        # not happen to the model being trained.
        before = measure_acceptance(target_model, tokenizer, build_shallow_drafter(target_model, layer_indices=layers),
                                    heldout_ids, heldout_plain, settings, target, bar, "acceptance before")
        eval_s = time.perf_counter() - t0

        drafter = build_shallow_drafter(target_model, layer_indices=layers).float()
        trainable = sum(p.numel() for p in trainable_parameters(drafter))
        losses, train_s = train(drafter, examples, settings, bar)

        save_drafter(drafter, tokenizer, staging)
        t0 = time.perf_counter()
        saved, _ = load_model(str(staging), dtype=next(drafter.parameters()).dtype, device=next(drafter.parameters()).device)
        after = measure_acceptance(target_model, tokenizer, saved, heldout_ids, heldout_plain, settings, target,
                                   bar, "acceptance after")
        eval_s += time.perf_counter() - t0

        report = DistillReport(
            out_dir=str(path), target=target_spec, layer_indices=layers, settings=settings, before=before, after=after,
            num_train_sequences=len(examples), num_train_tokens=sum(int(e[0].shape[0]) for e in examples),
            num_heldout_prompts=len(heldout), train_steps=len(losses),
            train_loss_first=losses[0] if losses else float("nan"), train_loss_last=losses[-1] if losses else float("nan"),
            data_s=data_s, train_s=train_s, eval_s=eval_s, trainable_params=trainable, losses=losses,
        )
        (staging / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return report


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    if not enabled:
        return _NoProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )


# ---------------------------------------------------------------- command line


def add_distill_parser(subparsers) -> None:
    """Add ``fastdecode distill-drafter`` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "distill-drafter",
        help="build a shallow drafter from the target's own layers and distil it on the target's outputs",
        description="Build a drafter from a few of the target's layers (with its embeddings and LM head), train it "
        "briefly to match the target's next-token distribution on the target's own greedy outputs (forward KL, "
        "DistillSpec), save it as a model directory for --draft-model, and report its acceptance before and after.",
    )
    d = DistillSettings()
    p.add_argument("--model", default=None, help="the target: built-in name, .gguf file, model directory or hub id (default: smollm2-135m)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a hub model's own Python code to run")
    p.add_argument("--out", required=True, help="directory to save the drafter in (new or empty)")
    p.add_argument("--layers", type=int, default=d.num_layers, help="number of the target's layers to take, evenly spread, first and last included (default: %(default)s)")
    p.add_argument("--layer-indices", default=None, help="exactly which target layers to take, e.g. 0,10,19,29 (overrides --layers)")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="training prompts the target continues (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="target tokens generated per training prompt (default: %(default)s)")
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="time budget of the training loop (default: %(default)s)")
    p.add_argument("--draft-k", type=int, default=d.draft_k, help="K when measuring acceptance (default: %(default)s)")
    p.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens, help="tokens per held-out prompt when measuring acceptance (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_distill)


def _parse_indices(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    from fastdecode._cli_util import int_list

    try:
        return int_list(text)
    except Exception:
        raise ConfigError(f"--layer-indices takes comma-separated integers, got {text!r}") from None


def cmd_distill(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from fastdecode.loading import DEFAULT_MODEL, load_model

    spec = args.model or DEFAULT_MODEL
    settings = DistillSettings(
        num_layers=args.layers, layer_indices=_parse_indices(args.layer_indices), steps=args.steps, lr=args.lr,
        batch_size=args.batch_size, seq_len=args.seq_len, num_prompts=args.num_prompts, new_tokens=args.new_tokens,
        max_minutes=args.max_minutes, draft_k=args.draft_k, eval_new_tokens=args.eval_new_tokens, seed=args.seed,
    )
    model, tokenizer = load_model(spec, dtype="float32", device=args.device, trust_remote_code=args.trust_remote_code)
    report = distill_drafter(model, tokenizer, args.out, settings, progress=not args.no_progress, target_spec=spec)

    console = Console()
    table = Table(title=f"drafter {report.layer_indices} of {spec}: {report.num_heldout_prompts} held-out prompts, greedy, K={settings.draft_k}")
    for column in ("training", "alpha", "tau", "KL(p||q)", "lossless"):
        table.add_column(column, justify="right")
    for name, f in (("before", report.before), ("after", report.after)):
        table.add_row(name, f"{f.alpha:.3f}", f"{f.tau:.2f}", f"{f.kl_nats_per_token:.3f}", "yes" if f.lossless else "NO")
    console.print(table)
    console.print("alpha: accepted / drafted tokens; tau: tokens per verification step, bonus token included; KL in nats per token")
    console.print(
        f"trained {report.train_steps} steps on {report.num_train_sequences} target sequences ({report.num_train_tokens} tokens) "
        f"in {report.train_s:.0f} s; target outputs {report.data_s:.0f} s, acceptance runs {report.eval_s:.0f} s; "
        f"loss {report.train_loss_first:.3f} -> {report.train_loss_last:.3f}"
    )
    console.print(f"saved to {report.out_dir}; use it with: fastdecode generate --model {spec} --drafter draft-model --draft-model {report.out_dir}")
    return 0
