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

Where each part lives: the drafter's construction in ``distill.model``; the
settings, the loss, the training loop and the acceptance measurement in
``distill.train``; here the target's data, the recipe that runs the flow end
to end, and the ``distill-drafter`` command. Every public name of the three
is importable from here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdecode.distill.model import (
    build_shallow_drafter,
    check_layer_indices,
    default_layer_indices,
    trainable_parameters,
)
from fastdecode.distill.train import (
    AcceptanceFigures,
    DistillSettings,
    kl_per_token,
    measure_acceptance,
    train,
    truncated_kl,
)
from fastdecode.errors import ConfigError
from fastdecode.util.progress import rich_progress

__all__ = [
    "REPORT_FILE",
    "AcceptanceFigures",
    "DistillReport",
    "DistillSettings",
    "add_distill_parser",
    "build_shallow_drafter",
    "check_layer_indices",
    "cmd_distill",
    "default_layer_indices",
    "default_prompts",
    "distill_drafter",
    "kl_per_token",
    "measure_acceptance",
    "save_drafter",
    "target_sequences",
    "teacher_top_logprobs",
    "train",
    "trainable_parameters",
    "training_examples",
    "truncated_kl",
]

REPORT_FILE = "fastdecode_distill.json"


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


# ---------------------------------------------------------------- data


def default_prompts(num_train: int) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts) from the built-in suite.

    Held out: the last prompt of each category, never seen in training in any
    form. Training: the other suite prompts, then instructions over ~300-character
    chunks of their text (the calibration text minus the held-out prompts, so
    nothing held out leaks in), cycling through a few instruction kinds.
    """
    from fastdecode.data.suite import builtin_suite

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


def target_sequences(
    engine, prompts: Sequence, new_tokens: int, progress=None, task=None
) -> list[tuple[list[int], list[int]]]:
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


def training_examples(
    target_model, sequences: Sequence[tuple[list[int], list[int]]], settings: DistillSettings, progress=None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``train``'s examples from (prompt ids, continuation) pairs: the last ``settings.seq_len``
    tokens of each as ids [T], with p's top-k log-probabilities and token ids [T, k], on the CPU."""
    device = next(target_model.parameters()).device
    examples = []
    task = progress.add_task("target top-k log p", total=len(sequences), note="") if progress is not None else None
    for ids, new in sequences:
        seq = torch.tensor((ids + new)[-settings.seq_len :], dtype=torch.long, device=device)
        top_log_p, top_ids = teacher_top_logprobs(target_model, seq, settings.top_k_logprobs)
        examples.append((seq.cpu(), top_log_p.cpu(), top_ids.cpu()))
        if progress is not None:
            progress.advance(task)
    return examples


# ---------------------------------------------------------------- the whole recipe


def _prepare_out_dir(out_dir) -> Path:
    """A new or empty directory, or an earlier distill output (never overwrite someone's files).
    Checked before any work; created only when the output is complete."""
    from fastdecode.util.files import check_output_dir

    return check_output_dir(out_dir, "drafter", allow_nonempty_if=lambda p: (p / REPORT_FILE).is_file())


def save_drafter(drafter, tokenizer, out_dir) -> None:
    from fastdecode.util.quiet import quiet

    with quiet(uses_transformers=True):
        drafter.save_pretrained(out_dir)  # safetensors
        tokenizer.save_pretrained(out_dir)


def _resolve_prompts(
    settings: DistillSettings, train_prompts: Sequence | None, heldout_prompts: Sequence | None
) -> tuple[Sequence, Sequence]:
    """The training and held-out prompts: those given, ``default_prompts`` for those not."""
    if train_prompts is None or heldout_prompts is None:
        default_train, default_heldout = default_prompts(settings.num_prompts)
        train_prompts = default_train if train_prompts is None else train_prompts
        heldout_prompts = default_heldout if heldout_prompts is None else heldout_prompts
    if not train_prompts or not heldout_prompts:
        raise ConfigError("distillation needs at least one training and one held-out prompt")
    return train_prompts, heldout_prompts


def _target_data(engine, target_model, train_prompts: Sequence, heldout_prompts: Sequence, settings, bar):
    """The target's greedy continuations of both prompt sets, and ``train``'s examples from the
    training ones: ``(examples, heldout sequences, seconds taken)``."""
    t0 = time.perf_counter()
    task = (
        bar.add_task("target outputs", total=len(train_prompts) + len(heldout_prompts), note="")
        if bar is not None
        else None
    )
    train_seqs = target_sequences(engine, train_prompts, settings.new_tokens, bar, task)
    heldout = target_sequences(engine, heldout_prompts, settings.eval_new_tokens, bar, task)
    examples = training_examples(target_model, train_seqs, settings, bar)
    return examples, heldout, time.perf_counter() - t0


def _acceptance_before(target_model, tokenizer, layers, heldout, settings, target, bar):
    """The untrained drafter's acceptance on the held-out sequences: ``(figures, seconds)``."""
    t0 = time.perf_counter()
    # A fresh copy for the before figures: the draft-model drafter's native
    # decoder re-points a model's projections at fused copies, which must
    # not happen to the model being trained.
    before = measure_acceptance(
        target_model,
        tokenizer,
        build_shallow_drafter(target_model, layer_indices=layers),
        [ids for ids, _ in heldout],
        [new for _, new in heldout],
        settings,
        target,
        bar,
        "acceptance before",
    )
    return before, time.perf_counter() - t0


def _acceptance_after(target_model, tokenizer, drafter, saved_dir: Path, heldout, settings, target, bar):
    """The saved drafter's acceptance, loaded back from ``saved_dir`` so that the figures describe
    the files on disk: ``(figures, seconds)``."""
    from fastdecode.loading import load_model

    t0 = time.perf_counter()
    saved, _ = load_model(
        str(saved_dir), dtype=next(drafter.parameters()).dtype, device=next(drafter.parameters()).device
    )
    after = measure_acceptance(
        target_model,
        tokenizer,
        saved,
        [ids for ids, _ in heldout],
        [new for _, new in heldout],
        settings,
        target,
        bar,
        "acceptance after",
    )
    return after, time.perf_counter() - t0


def distill_drafter(
    target_model,
    tokenizer,
    out_dir,
    settings: DistillSettings | None = None,
    progress: bool = True,
    *,
    target_spec: str = "",
    train_prompts: Sequence | None = None,
    heldout_prompts: Sequence | None = None,
) -> DistillReport:
    """Build a shallow drafter from ``target_model``, distil it on the target's
    own greedy outputs, save it to ``out_dir`` (a Hugging Face model directory
    that ``load_model`` and ``--draft-model`` take) and report its acceptance
    on held-out prompts before and after training.

    ``train_prompts`` / ``heldout_prompts`` (text or token ids) default to
    ``default_prompts(settings.num_prompts)``; given, they are used as they are.
    """
    from fastdecode.backends import make_target
    from fastdecode.engine import Engine
    from fastdecode.util.files import staged_dir

    settings = settings or DistillSettings()
    layers = check_layer_indices(target_model.config.num_hidden_layers, settings.num_layers, settings.layer_indices)
    path = _prepare_out_dir(out_dir)
    train_prompts, heldout_prompts = _resolve_prompts(settings, train_prompts, heldout_prompts)
    torch.manual_seed(settings.seed)
    target_model.eval()
    target = make_target(target_model)
    engine = Engine(target_model, tokenizer, target=target)

    # Everything is written into a staging directory and moved into ``path`` at the end, the
    # report last: an error or Ctrl-C leaves no half-written drafter.
    with _progress(progress) as bar, staged_dir(path, marker=REPORT_FILE) as staging:
        examples, heldout, data_s = _target_data(engine, target_model, train_prompts, heldout_prompts, settings, bar)
        before, eval_s = _acceptance_before(target_model, tokenizer, layers, heldout, settings, target, bar)

        drafter = build_shallow_drafter(target_model, layer_indices=layers).float()
        trainable = sum(p.numel() for p in trainable_parameters(drafter))
        losses, train_s = train(drafter, examples, settings, bar)

        save_drafter(drafter, tokenizer, staging)
        after, after_s = _acceptance_after(target_model, tokenizer, drafter, staging, heldout, settings, target, bar)
        eval_s += after_s

        report = DistillReport(
            out_dir=str(path),
            target=target_spec,
            layer_indices=layers,
            settings=settings,
            before=before,
            after=after,
            num_train_sequences=len(examples),
            num_train_tokens=sum(int(e[0].shape[0]) for e in examples),
            num_heldout_prompts=len(heldout),
            train_steps=len(losses),
            train_loss_first=losses[0] if losses else float("nan"),
            train_loss_last=losses[-1] if losses else float("nan"),
            data_s=data_s,
            train_s=train_s,
            eval_s=eval_s,
            trainable_params=trainable,
            losses=losses,
        )
        (staging / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return report


def _progress(enabled: bool):
    """The bars of a distillation on stdout (each with its note: the loss), or None when not ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    from rich import get_console

    return rich_progress(console=get_console(), description="{task.description:<20}", note=True)


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
    p.add_argument(
        "--model",
        default=None,
        help="the target: built-in name, .gguf file, model directory or hub id (default: smollm2-135m)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a hub model's own Python code to run")
    p.add_argument("--out", required=True, help="directory to save the drafter in (new or empty)")
    p.add_argument(
        "--layers",
        type=int,
        default=d.num_layers,
        help="number of the target's layers to take, evenly spread, first and last included (default: %(default)s)",
    )
    p.add_argument(
        "--layer-indices",
        default=None,
        help="exactly which target layers to take, e.g. 0,10,19,29 (overrides --layers)",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence (default: %(default)s)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=d.num_prompts,
        help="training prompts the target continues (default: %(default)s)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=d.new_tokens,
        help="target tokens generated per training prompt (default: %(default)s)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=d.max_minutes,
        help="time budget of the training loop (default: %(default)s)",
    )
    p.add_argument("--draft-k", type=int, default=d.draft_k, help="K when measuring acceptance (default: %(default)s)")
    p.add_argument(
        "--eval-new-tokens",
        type=int,
        default=d.eval_new_tokens,
        help="tokens per held-out prompt when measuring acceptance (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_distill)


def _parse_indices(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    from fastdecode.util.commands import int_list

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
        num_layers=args.layers,
        layer_indices=_parse_indices(args.layer_indices),
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        num_prompts=args.num_prompts,
        new_tokens=args.new_tokens,
        max_minutes=args.max_minutes,
        draft_k=args.draft_k,
        eval_new_tokens=args.eval_new_tokens,
        seed=args.seed,
    )
    # the drafter is trained from the target's float weights: a GGUF file is dequantized
    model, tokenizer = load_model(
        spec, dtype="float32", device=args.device, trust_remote_code=args.trust_remote_code, lazy=False
    )
    report = distill_drafter(model, tokenizer, args.out, settings, progress=not args.no_progress, target_spec=spec)

    console = Console()
    table = Table(
        title=f"drafter {report.layer_indices} of {spec}: {report.num_heldout_prompts} held-out prompts, greedy, K={settings.draft_k}"
    )
    for column in ("training", "alpha", "tau", "KL(p||q)", "lossless"):
        table.add_column(column, justify="right")
    for name, f in (("before", report.before), ("after", report.after)):
        table.add_row(
            name, f"{f.alpha:.3f}", f"{f.tau:.2f}", f"{f.kl_nats_per_token:.3f}", "yes" if f.lossless else "NO"
        )
    console.print(table)
    console.print(
        "alpha: accepted / drafted tokens; tau: tokens per verification step, bonus token included; KL in nats per token"
    )
    console.print(
        f"trained {report.train_steps} steps on {report.num_train_sequences} target sequences ({report.num_train_tokens} tokens) "
        f"in {report.train_s:.0f} s; target outputs {report.data_s:.0f} s, acceptance runs {report.eval_s:.0f} s; "
        f"loss {report.train_loss_first:.3f} -> {report.train_loss_last:.3f}"
    )
    console.print(
        f"saved to {report.out_dir}; use it with: fastdecode generate --model {spec} --drafter draft-model --draft-model {report.out_dir}"
    )
    return 0
