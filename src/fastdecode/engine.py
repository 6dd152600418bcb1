"""The decode loop: prefill, then draft -> verify -> roll back, one step at a time.

Plain decoding is the same loop with an empty draft, so every drafter shares
one code path for stopping, streaming, timing and sampling. The loop owns the
target's KV cache; drafters only propose (``fastdecode.drafters.base``) and
verification is a pure function (``fastdecode.verify``).

Cache invariant: before a step the cache holds every context token but the
last, which is fed together with the draft (k + 1 tokens); afterwards the cache
is truncated to the context plus the accepted draft tokens, leaving the bonus
token as the new last, unfed token.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from fastdecode.backends import Target, make_target
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.errors import ConfigError, IncompatibleDrafterError, PromptTooLongError
from fastdecode.metrics import AcceptanceStats, GenerationResult
from fastdecode.sampling import SamplingParams, make_generator, probabilities
from fastdecode.verify import verify_greedy, verify_sampling


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    draft_k: int = 7  # ANPD's K: tokens drafted per step (the initial value when adaptive)
    adaptive_k: bool = False
    cost_aware_k: bool = False  # choose K each step from measured verify cost and acceptance (CostAwareK)
    max_draft_k: int | None = None  # upper bound for adaptive K; default 2 * draft_k

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.draft_k, bool) or not isinstance(self.draft_k, int) or self.draft_k < 1:
            raise ConfigError(f"draft_k must be an integer >= 1, got {self.draft_k!r}")
        if self.max_draft_k is not None and (isinstance(self.max_draft_k, bool) or not isinstance(self.max_draft_k, int) or self.max_draft_k < self.draft_k):
            raise ConfigError(f"max_draft_k must be an integer >= draft_k ({self.draft_k}), got {self.max_draft_k!r}")
        if self.adaptive_k and self.cost_aware_k:
            raise ConfigError("choose one draft length policy: adaptive_k or cost_aware_k")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")

    @classmethod
    def from_options(cls, base: "GenerationConfig | None" = None, **options) -> "GenerationConfig":
        """Build from flat keyword options (``temperature=``, ``draft_k=``, ...);
        an unknown option is an error, never silently dropped."""
        base = base or cls()
        sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
        own_fields = {f.name for f in dataclasses.fields(cls)} - {"sampling"}
        unknown = set(options) - sampling_fields - own_fields
        if unknown:
            raise ConfigError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        sampling = dataclasses.replace(base.sampling, **{k: v for k, v in options.items() if k in sampling_fields})
        return dataclasses.replace(base, sampling=sampling, **{k: v for k, v in options.items() if k in own_fields})


class AdaptiveK:
    """Draft length policy: grow by 2 after a fully accepted draft, shrink by 1
    after a rejection (transformers' heuristic), within [1, k_max]."""

    def __init__(self, k: int, k_max: int, enabled: bool) -> None:
        self.k, self.k_max, self.enabled = k, k_max, enabled

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if not self.enabled or num_drafted == 0:
            return
        if num_accepted == num_drafted:
            self.k = min(self.k + 2, self.k_max)
        else:
            self.k = max(self.k - 1, 1)


class CostAwareK:
    """Draft length from a cost model: each step, pick the k in [0, k_max] that
    maximizes expected tokens per second, E(k) / T(k).

    * E(k) = 1 + sum_{j=1..k} prod_{i<j} c_i, with c_i the estimated probability
      that draft position i is accepted given positions < i were (Laplace-smoothed
      counts from this request: an unseen position is optimistically 1/2);
    * T(k) = the measured time of a (k + 1)-token verification forward plus the
      drafter's measured time per drafted token. Forward times are a property of
      the hardware and backend, so they persist across requests; a size never
      measured is assumed to cost what the nearest smaller measured size did
      (optimistic, so it gets tried and measured).

    Why: the cost of a wider verification depends on the hardware and kernel.
    Measured (docs/benchmarks.md): a float32 forward of 8 tokens costs ~1.3x
    one of 1 token on fastdecode's kernels (2-core Zen 3), ~3.6x on MKL there,
    ~2.2x on MKL on a Sapphire Rapids (where 2 tokens cost ~1.05x), ~1.15x in
    bf16 with AMX. A fixed K is right for one of those and wrong for the others.
    """

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.forward_s: dict[int, float] = {}  # tokens fed -> EMA of seconds
        self.draft_s_per_token = 0.0
        self.begin()

    EXPLORE_EVERY = 8  # steps: after this many without a draft, try k = 1 once

    def begin(self) -> None:
        self.reached = [0] * self.k_max
        self.accepted = [0] * self.k_max
        self._idle_steps = 0

    def record_forward(self, num_tokens: int, seconds: float) -> None:
        old = self.forward_s.get(num_tokens)
        self.forward_s[num_tokens] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def record_draft(self, num_drafted: int, seconds: float) -> None:
        if num_drafted:
            per_token = seconds / num_drafted
            first = self.draft_s_per_token == 0.0
            self.draft_s_per_token = per_token if first else 0.8 * self.draft_s_per_token + 0.2 * per_token

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self._idle_steps = self._idle_steps + 1 if num_drafted == 0 else 0
        for i in range(min(num_accepted + 1, num_drafted)):
            self.reached[i] += 1
            if i < num_accepted:
                self.accepted[i] += 1

    def _forward_time(self, n: int) -> float:
        known = [m for m in self.forward_s if m <= n]
        return self.forward_s[max(known)] if known else 0.0

    @property
    def k(self) -> int:
        if 1 not in self.forward_s:
            return self.k_max  # nothing measured yet: try the widest draft
        best_k, best_rate, expected, survive = 0, 1.0 / self.forward_s[1], 1.0, 1.0
        for k in range(1, self.k_max + 1):
            c = (self.accepted[k - 1] + 1) / (self.reached[k - 1] + 2)
            survive *= c
            expected += survive
            rate = expected / (self._forward_time(k + 1) + k * self.draft_s_per_token)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0 and self._idle_steps >= self.EXPLORE_EVERY:
            # Without drafting nothing new is learned: the text may have turned
            # repetitive since the estimates were made.
            return 1
        return best_k


@dataclass
class Step:
    """What one step of the loop appended (the prefill's first token is a step with no draft)."""

    token_ids: list[int]
    text: str  # newly decodable text (held back while it could be a partial stop string)
    num_drafted: int
    num_accepted: int


class _TextTracker:
    """Decodes the new tokens, finds stop strings, and releases text for streaming."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.text = ""
        self.released = 0
        self.stop_at: int | None = None

    def update(self, new_tokens: list[int]) -> bool:
        """Re-decode; return True when a stop string has appeared."""
        self.text = self.tokenizer.decode(new_tokens, skip_special_tokens=True)
        if self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.stop_at = min(hits)
                self.text = self.text[: self.stop_at]
                return True
        return False

    def release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            # a multi-byte character split across tokens decodes as U+FFFD until complete
            end = len(self.text.rstrip("\ufffd"))
            for s in self.stop:  # hold back a suffix that may grow into a stop string
                for n in range(min(len(s) - 1, end), 0, -1):
                    if self.text[end - n : end] == s[:n]:
                        end -= n
                        break
        end = max(end, self.released)
        delta = self.text[self.released : end]
        self.released = end
        return delta


class GenerationStream:
    """Iterate for :class:`Step` objects; ``result`` is set once iteration ends."""

    def __init__(self, steps: Iterator[Step]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Step]:
        return self._steps


class Engine:
    """Generation with an optional drafter, over a target model.

    ``Engine(model, tokenizer)`` decodes plainly; ``Engine(model, tokenizer,
    drafter=build_drafter("ngram"))`` decodes speculatively with identical
    greedy output and the same sampling distribution.
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter: Drafter | None = None,
        target: Target | None = None,
        config: GenerationConfig | None = None,
    ) -> None:
        self.model = model
        self.config = config or GenerationConfig()  # defaults for every request
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.target = target if target is not None else make_target(model)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self._cost_policy: CostAwareK | None = None  # its forward timings outlive a request
        if drafter is not None:
            _check_lossless_target(self.target, model)
            drafter.check_target(tokenizer, self.target.vocab_size)

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    def encode(self, prompt: str | Sequence[int], chat: bool | None = None) -> list[int]:
        """Token ids for ``prompt``; with ``chat`` (default: when the tokenizer
        has a chat template) the prompt becomes one user message."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        else:
            has_template = bool(getattr(self.tokenizer, "chat_template", None))
            if chat and not has_template:
                raise ConfigError("this model has no chat template; send raw text (--no-chat)")
            if chat is None:
                chat = has_template
            if chat:
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                )
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids

    def stream(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, chat: bool | None = None, **options
    ) -> GenerationStream:
        config = GenerationConfig.from_options(config or self.config, **options)
        t_start = time.perf_counter()
        prompt_ids = self.encode(prompt, chat)
        if len(prompt_ids) >= self.target.context_length:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens but the model's context length is "
                f"{self.target.context_length}: no room for a new token"
            )
        stream = GenerationStream(iter(()))
        stream._steps = self._run(prompt_ids, config, t_start, stream)
        return stream

    def generate(
        self, prompt: str | Sequence[int], config: GenerationConfig | None = None, chat: bool | None = None, **options
    ) -> GenerationResult:
        stream = self.stream(prompt, config, chat, **options)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    @torch.inference_mode()
    def _run(self, prompt_ids: list[int], config: GenerationConfig, t_start: float, stream: GenerationStream):
        params = config.sampling
        target, drafter = self.target, self.drafter
        generator = None if params.greedy else make_generator(params, target.device)
        stats = AcceptanceStats(draft_k=config.draft_k) if drafter is not None else None
        k_max = config.max_draft_k or 2 * config.draft_k
        if config.cost_aware_k:
            if self._cost_policy is None or self._cost_policy.k_max != k_max:
                self._cost_policy = CostAwareK(k_max)
            k_policy = self._cost_policy
            k_policy.begin()
        else:
            k_policy = AdaptiveK(config.draft_k, k_max, config.adaptive_k)
        cost_aware = config.cost_aware_k and drafter is not None
        text = _TextTracker(self.tokenizer, config.stop)

        target.reset()
        if drafter is not None:
            drafter_generator = None
            if generator is not None:
                drafter_generator = torch.Generator(device=target.device)
                drafter_generator.manual_seed(int(torch.randint(2**62, (1,), generator=generator, device=target.device)))
            drafter.set_sampling(params, drafter_generator)
            drafter.begin(prompt_ids)
        context = list(prompt_ids)
        new_tokens: list[int] = []
        finish_reason = None

        def pick(logits: torch.Tensor) -> int:  # logits: [1, vocab_size]
            if params.greedy:
                return int(logits[0].argmax())
            return int(torch.multinomial(probabilities(logits, params)[0], 1, generator=generator))

        def emit(tokens: list[int]) -> list[int]:
            """Append tokens one by one, stopping exactly at EOS, a stop string or a limit."""
            nonlocal finish_reason
            taken = []
            for tok in tokens:
                context.append(tok)
                new_tokens.append(tok)
                taken.append(tok)
                if tok in self.eos_token_ids:
                    finish_reason = "eos"
                elif config.stop and text.update(new_tokens):
                    finish_reason = "stop"
                elif len(new_tokens) >= config.max_new_tokens:
                    finish_reason = "length"
                elif len(context) >= target.context_length:
                    finish_reason = "context"
                if finish_reason:
                    break
            return taken

        first = pick(target.forward(prompt_ids, 1))
        t_first = time.perf_counter()
        taken = emit([first])
        if not config.stop or finish_reason:
            text.update(new_tokens)
        yield Step(taken, text.release(finish_reason is not None), 0, 0)

        while finish_reason is None:
            remaining = min(config.max_new_tokens - len(new_tokens), target.context_length - len(context))
            k = min(k_policy.k, remaining - 1)
            t_draft = time.perf_counter()
            draft = drafter.propose(context, k) if drafter is not None and k > 0 else Draft([])
            if len(draft) > k:  # a drafter may not overrun the limits the loop set
                draft = Draft(draft.tokens[:k], None if draft.q is None else draft.q[:k])
            t_verify = time.perf_counter()  # drafts end in int(): any device work is done
            logits = target.forward([context[-1], *draft.tokens], len(draft) + 1)  # [k + 1, vocab_size]
            if params.greedy:
                n, bonus = verify_greedy(draft.tokens, logits.argmax(dim=-1))
            else:
                n, bonus = verify_sampling(draft.tokens, probabilities(logits, params), draft.q, generator)
            if cost_aware:  # timed after verification, whose int() waits for the device
                k_policy.record_draft(len(draft), t_verify - t_draft)
                k_policy.record_forward(len(draft) + 1, time.perf_counter() - t_verify)
            appended = [*draft.tokens[:n], bonus]
            target.truncate(len(context) + n)
            taken = emit(appended)
            if drafter is not None:
                drafter.observe(appended, n)
                stats.record(len(draft), n, len(taken))
                k_policy.update(len(draft), n)
            if not config.stop or finish_reason:
                text.update(new_tokens)
            yield Step(taken, text.release(finish_reason is not None), len(draft), n)

        t_end = time.perf_counter()
        decode_s = t_end - t_first
        stream.result = GenerationResult(
            token_ids=new_tokens,
            text=text.text,
            num_prompt_tokens=len(prompt_ids),
            num_new_tokens=len(new_tokens),
            ttft_s=t_first - t_start,
            decode_tokens_per_s=(len(new_tokens) - 1) / decode_s if len(new_tokens) > 1 and decode_s > 0 else 0.0,
            wall_s=t_end - t_start,
            finish_reason=finish_reason,
            drafter=self.drafter_name,
            acceptance=stats,
        )


def _check_lossless_target(target: Target, model) -> None:
    """Refuse a target whose verification pass is known not to reproduce its decode steps.

    The native decoder is row-invariant by construction. transformers' forward
    is not: multi-token passes take other kernels than one-token steps. In
    float32 the difference is ~1e-6 and never changed a greedy token in our
    tests and benchmarks; in bf16/fp16 or with low-bit weights (activations cast
    to bf16) it changed most 128-token outputs we measured. Refuse those."""
    if target.name != "hf":
        return
    dtype = next(model.parameters()).dtype
    if target.weights != "float" or dtype != torch.float32:
        raise IncompatibleDrafterError(
            f"speculative decoding on the transformers backend is token-identical only in float32 with float "
            f"weights (this target: {str(dtype).replace('torch.', '')}, {target.weights} weights); "
            "use --backend native (Llama-family models) or float32"
        )


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
