"""Training and judging a distilled drafter: the settings, the loss, the loop, and
acceptance on held-out prompts (terms as in ``fastdecode.distill.command``: **p** the
target's next-token distribution, **q** the drafter's)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdecode.distill.model import trainable_parameters
from fastdecode.errors import ConfigError


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

        for name, low in [
            ("num_layers", 1),
            ("steps", 1),
            ("batch_size", 1),
            ("seq_len", 2),
            ("num_prompts", 1),
            ("new_tokens", 1),
            ("draft_k", 1),
            ("eval_new_tokens", 1),
            ("top_k_logprobs", 1),
            ("seed", 0),
        ]:
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


# ---------------------------------------------------------------- the loss


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


def train(
    drafter,
    examples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    settings: DistillSettings,
    progress=None,
) -> tuple[list[float], float]:
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


def measure_acceptance(
    target_model,
    tokenizer,
    drafter_model,
    prompt_ids: Sequence[list[int]],
    plain_outputs: Sequence[list[int]],
    settings: DistillSettings,
    target=None,
    progress=None,
    description: str = "acceptance",
) -> AcceptanceFigures:
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
        steps, drafted, accepted, step_tokens = (
            steps + a.steps,
            drafted + a.drafted_tokens,
            accepted + a.accepted_tokens,
            step_tokens + a.step_tokens,
        )
        if progress is not None:
            progress.advance(task)
    kl = kl_per_token(
        target_model, drafter_model, [list(ids) + list(plain) for ids, plain in zip(prompt_ids, plain_outputs)]
    )
    return AcceptanceFigures(
        alpha=accepted / drafted if drafted else 0.0,
        tau=step_tokens / steps if steps else 0.0,
        kl_nats_per_token=kl,
        steps=steps,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        lossless=lossless,
    )
