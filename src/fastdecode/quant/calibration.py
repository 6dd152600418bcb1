"""Activation statistics for the calibration-based methods (AWQ, SmoothQuant).

The float model runs over calibration sequences while forward pre-hooks on its linear
layers record, per input channel j of each layer's input X [tokens, in_features]:

* ``abs_max[j]`` = max over tokens of |X_j| (SmoothQuant's max|X_j|);
* ``abs_mean[j]`` = mean over tokens of |X_j| (AWQ's activation magnitude);
* optionally ``rows``: at most ``max_rows`` tokens of X itself, evenly spaced over the
  calibration tokens, for a method that measures output error (AWQ's scale and clip
  search). Memory is bounded by ``max_rows * in_features`` floats per recorded layer,
  whatever the number of sequences.

The calibration text is :func:`fastdecode.data.corpora.calibration_text` (kept apart from the
evaluation text), cut into ``num_sequences`` non-overlapping windows of ``seq_len``
tokens. The papers calibrate on 128 sequences of 512 tokens (AWQ: the Pile; SmoothQuant:
the Pile validation set); on a CPU the methods default to fewer (:data:`DEFAULT_SEQUENCES`
of :data:`DEFAULT_SEQ_LEN`), and a shorter text gives as many windows as it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fastdecode.data.corpora import calibration_text
from fastdecode.errors import ConfigError

DEFAULT_SEQUENCES = 16  # the papers: 128
DEFAULT_SEQ_LEN = 512  # the papers: 512
DEFAULT_MAX_ROWS = 512  # tokens of X kept per layer for an error search (AWQ's clip search samples 512 too)


@dataclass(frozen=True)
class CalibrationSettings:
    """Where calibration comes from and how much of it: ``token_ids`` (sequences used as
    given, each cut to ``seq_len``), else ``text``, else the shipped calibration text;
    tokenized with the tokenizer handed to ``quantize_`` and cut into at most
    ``num_sequences`` windows of ``seq_len`` tokens."""

    num_sequences: int = DEFAULT_SEQUENCES
    seq_len: int = DEFAULT_SEQ_LEN
    text: str | None = None
    token_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.num_sequences < 1 or self.seq_len < 2:
            raise ConfigError(
                f"calibration needs num_sequences >= 1 and seq_len >= 2, got {self.num_sequences}, {self.seq_len}"
            )
        if self.token_ids is not None:
            ids = tuple(tuple(int(t) for t in seq) for seq in self.token_ids)
            if not ids or not all(ids):
                raise ConfigError("calibration token_ids must hold at least one non-empty sequence")
            object.__setattr__(self, "token_ids", ids)

    def describe(self) -> str:
        """The source, for a saved model's record (the data itself is not copied)."""
        if self.token_ids is not None:
            source = f"{len(self.token_ids)} token-id sequences"
        elif self.text is not None:
            source = f"a text of {len(self.text)} chars"
        else:
            source = "fastdecode.data.corpora.calibration_text()"
        return f"{source}, up to {self.num_sequences} x {self.seq_len} tokens"


class CalibratedConfig:
    """What a calibrated compression config (AWQ, SmoothQuant, pruning) shares: its fields
    ``num_sequences``, ``seq_len``, ``calibration_text`` and ``calibration_token_ids`` read as one
    :class:`CalibrationSettings`. A frozen dataclass calls :meth:`freeze_calibration` from its
    ``__post_init__``."""

    num_sequences: int
    seq_len: int
    calibration_text: str | None
    calibration_token_ids: tuple[tuple[int, ...], ...] | None

    @property
    def calibration(self) -> CalibrationSettings:
        return CalibrationSettings(self.num_sequences, self.seq_len, self.calibration_text, self.calibration_token_ids)

    def freeze_calibration(self) -> None:
        """CalibrationSettings validates the calibration options; keep its frozen ids (tuples of ints)."""
        object.__setattr__(self, "calibration_token_ids", self.calibration.token_ids)


def calibration_samples(settings: CalibrationSettings, tokenizer) -> list[torch.Tensor]:
    """The calibration sequences, each a LongTensor [<= seq_len]."""
    if settings.token_ids is not None:
        return [torch.tensor(ids[: settings.seq_len], dtype=torch.long) for ids in settings.token_ids]
    if tokenizer is None:
        raise ConfigError("calibrating on text needs a tokenizer (pass tokenizer= to quantize_, or token_ids)")
    text = settings.text if settings.text is not None else calibration_text()
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) < 2:
        raise ConfigError("the calibration text tokenized to fewer than two tokens")
    n = settings.seq_len
    windows = [ids[i : i + n] for i in range(0, len(ids), n)]
    full = [w for w in windows if len(w) == n] or windows[:1]  # a short tail only when it is all there is
    return [torch.tensor(w, dtype=torch.long) for w in full[: settings.num_sequences]]


@dataclass
class ActivationStats:
    """One linear layer's input statistics over the calibration tokens."""

    abs_max: torch.Tensor  # [in_features] float32: max |X_j|
    abs_sum: torch.Tensor  # [in_features] float64: sum |X_j|
    tokens: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # kept tokens of X, each [k, in_features] float32

    @property
    def abs_mean(self) -> torch.Tensor:  # [in_features] float32: mean |X_j|
        return (self.abs_sum / max(self.tokens, 1)).float()

    def inputs(self) -> torch.Tensor:  # [kept tokens, in_features]
        if not self.rows:
            raise ConfigError("no input rows were kept for this layer (collect with keep_rows)")
        return torch.cat(self.rows)


class _Recorder:
    def __init__(self, in_features: int, stride: int | None, max_rows: int) -> None:
        self.stats = ActivationStats(torch.zeros(in_features), torch.zeros(in_features, dtype=torch.float64))
        self.stride, self.max_rows, self.seen = stride, max_rows, 0

    def __call__(self, module, args) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, in_features]
        stats = self.stats
        a = x.abs()
        torch.maximum(stats.abs_max, a.amax(0), out=stats.abs_max)
        stats.abs_sum += a.sum(0, dtype=torch.float64)
        stats.tokens += x.shape[0]
        if self.stride is not None:
            # the tokens whose running index is a multiple of stride
            first = (-self.seen) % self.stride
            room = self.max_rows - sum(r.shape[0] for r in stats.rows)
            kept = x[first :: self.stride][:room]
            if kept.shape[0]:
                stats.rows.append(kept.clone())
        self.seen += x.shape[0]


@torch.no_grad()
def collect_activation_stats(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    samples: Sequence[torch.Tensor],
    keep_rows: Sequence[str] = (),
    max_rows: int = DEFAULT_MAX_ROWS,
) -> dict[str, ActivationStats]:
    """Run ``model`` (float) over ``samples`` (one sequence a forward) and return each of
    ``linears``' input statistics, by name; the layers named in ``keep_rows`` also keep up to
    ``max_rows`` of their input tokens, evenly spaced over all calibration tokens."""
    total = sum(int(s.numel()) for s in samples)
    stride = max(1, total // max(max_rows, 1))
    recorders = {
        name: _Recorder(linear.in_features, stride if name in keep_rows else None, max_rows)
        for name, linear in linears.items()
    }
    handles = [linears[name].register_forward_pre_hook(rec) for name, rec in recorders.items()]
    device = next(model.parameters()).device
    try:
        for ids in samples:
            model(input_ids=ids.unsqueeze(0).to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {name: rec.stats for name, rec in recorders.items()}
