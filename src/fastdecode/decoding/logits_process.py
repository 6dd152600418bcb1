"""Logits processors: penalties, bias, a minimum length and a grammar's mask, per row.

Pure functions of (a row's history, its logits), applied where the target's logits are
turned into tokens: the first token after a prompt, and every row of a verification pass
(``fastdecode.engine.verifier``). Row i of a pass scores the context *plus the draft's
first i tokens*, so its history is exactly that: a draft token's penalty state is the
state of the context it would extend. Plain decoding sees the same history at the same
position, so greedy speculative output is token-identical to plain decoding's and
sampling keeps its distribution, whatever the drafter.

Conventions (OpenAI's and vLLM's):

* ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]) count the *generated*
  tokens: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``;
* ``repetition_penalty`` (> 0, 1 = off; CTRL, as transformers and vLLM apply it) covers
  prompt and generated tokens: a positive logit is divided by it, a negative one multiplied;
* ``logit_bias``: ``{token_id: bias}``, bias in [-100, 100], added to the logit;
* ``min_tokens``: end-of-sequence tokens (every id the model ends with: vLLM's EOS and stop token ids)
  are forbidden until that many tokens are generated, and no stop string ends in their text
  (``fastdecode.decoding.detokenize``; vLLM's rule);
* ``grammar`` (``fastdecode.decoding.structured``): tokens the grammar forbids get -inf.

They apply in that order, on the float32 logits, before temperature, top-k and top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastdecode.decoding.structured import GrammarMatcher, GrammarSpec
from fastdecode.errors import ConfigError

MAX_BIAS = 100.0
MAX_BIAS_ENTRIES = 1024


def _number(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")


def bias_entries(logit_bias) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` (keys may be numeric strings, as JSON sends them) or pairs -> sorted pairs."""
    items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
    try:
        items = list(items)
    except TypeError:
        raise ConfigError("logit_bias must map token ids to numbers") from None
    if len(items) > MAX_BIAS_ENTRIES:
        raise ConfigError(f"logit_bias may hold at most {MAX_BIAS_ENTRIES} entries, got {len(items)}")
    out = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError("logit_bias must map token ids to numbers")
        key, bias = item
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        _number(f"logit_bias[{key}]", bias, -MAX_BIAS, MAX_BIAS)
        out[key] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class ProcessingParams:
    """A request's logits processors (the module docstring gives each one's meaning)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is taken too
    min_tokens: int = 0
    grammar: GrammarSpec | None = None  # a dict is taken as a JSON schema

    def __post_init__(self) -> None:
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 1e-3, 100.0)
        object.__setattr__(self, "logit_bias", bias_entries(self.logit_bias or ()))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if isinstance(self.grammar, dict):  # a JSON schema
            object.__setattr__(self, "grammar", GrammarSpec.json_schema(self.grammar))
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ConfigError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")

    @property
    def active(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.grammar is not None
        )


class LogitsProcessor:
    """One request's processors over its rows (the request owns it: the grammar's parser state)."""

    def __init__(
        self,
        params: ProcessingParams,
        prompt_ids: Sequence[int],
        eos_ids: Sequence[int],
        vocab_size: int,
        matcher: GrammarMatcher | None = None,
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.matcher = matcher
        outside = [t for t, _ in params.logit_bias if t >= vocab_size]
        if outside:
            raise ConfigError(f"logit_bias token id {outside[0]} is outside the vocabulary (size {vocab_size})")
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self.bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)
        if params.repetition_penalty != 1.0:
            self.prompt_seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading draft tokens may be verified (all, but where a grammar forbids one)."""
        return len(tokens) if self.matcher is None else self.matcher.valid_prefix(tokens)

    def advance(self, taken: Sequence[int]) -> None:
        if self.matcher is not None:
            self.matcher.advance(taken)

    def process(self, logits: torch.Tensor, generated: Sequence[int], path: Sequence[int]) -> torch.Tensor:
        """logits: [n, vocab_size], row i scoring the context extended by ``path[:i]`` (n <= len(path) + 1);
        ``generated``: the request's tokens so far. Returns new float32 rows, [n, vocab_size].
        Only the processors the request asked for do any work: token counts are made for the
        penalties alone, and the all-masked check runs only on a row that something masked
        (a request with only ``min_tokens``, past it, pays a copy of its rows)."""
        p = self.params
        n, device = logits.shape[0], logits.device
        out = logits.float().clone()
        penalized = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        if penalized:
            generated_ids = torch.tensor(list(generated), dtype=torch.long, device=device)
            counts = torch.bincount(generated_ids, minlength=self.vocab_size).float()
            seen = self.prompt_seen.to(device) | (counts > 0)
        bias_ids, bias, eos_ids = self.bias_ids.to(device), self.bias.to(device), self.eos_ids.to(device)
        masks = None
        if self.matcher is not None:
            masks = self.matcher.masks(path[: n - 1], out.shape[-1]).to(device)
        for i in range(n):
            if i and penalized:  # the row after draft token i - 1
                counts[path[i - 1]] += 1
                seen[path[i - 1]] = True
            row = out[i]
            if p.repetition_penalty != 1.0:
                scored = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, scored, row))
            if p.frequency_penalty or p.presence_penalty:
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
            if p.logit_bias:
                row.index_add_(0, bias_ids, bias)
            masked = len(generated) + i < p.min_tokens
            if masked:
                row[eos_ids] = float("-inf")
            if masks is not None:
                row.masked_fill_(~masks[i], float("-inf"))
            # min_tokens against a grammar that can only end: the grammar wins. A row nothing masked is
            # all -inf only if it came so (penalties and biases keep finite logits finite), and then
            # giving back its end tokens' logits would change nothing.
            if (masked or masks is not None) and torch.isneginf(row).all():
                row[eos_ids] = logits[i, eos_ids].float()
        return out


def processor_for(request, logits: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
    """A request's rows after its processors (the rows themselves when it has none)."""
    if request.processor is None:
        return logits
    return request.processor.process(logits, request.new_tokens, path)
