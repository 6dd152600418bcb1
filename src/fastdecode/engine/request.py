"""One request: everything about one sequence, owned in one place.

Its tokens, options, random streams, detokenizer, drafter, draft-length
state, acceptance stats, KV block table and finish reason live here; the
engine's shared executors (the target, its kernels) hold none of it.

Sampling randomness is keyed by position (``position_generator``): the token
at position t is drawn with a generator seeded from (request seed, t). A
request's tokens then depend neither on what else shares its batch nor on how
many draft tokens each step verified, so seeded sampling is reproducible at
any concurrency, and with a deterministic drafter (n-gram, prompt lookup, a
greedy draft model) speculative sampling gives exactly the tokens plain
sampling gives (``verify_by_matching``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fastdecode.decoding.metrics import AcceptanceStats, GenerationResult
from fastdecode.kv.cache import BlockTable

if TYPE_CHECKING:
    from fastdecode.decoding.detokenize import IncrementalDetokenizer
    from fastdecode.decoding.logits_process import LogitsProcessor
    from fastdecode.drafters.base import Drafter
    from fastdecode.engine.config import AdaptiveK, GenerationConfig
    from fastdecode.engine.guard import SpeculationGuard
    from fastdecode.engine.logprobs import TokenLogprob
    from fastdecode.kv.policy import KVState

_MASK63 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for (request seed, position): splitmix64's finalizer over both."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(position_seed(seed, position))
    return gen


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one engine step did for one request."""

    request_id: str
    token_ids: list[int]  # tokens appended this step (none while its prompt is being prefilled)
    text: str  # newly released text (held back while it could be part of a stop string)
    finished: bool
    finish_reason: str | None  # "eos" | "stop" | "length" | "context" | "abort"
    num_drafted: int = 0
    num_accepted: int = 0
    result: GenerationResult | None = None  # set when finished
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids (config.logprobs set)
    # config.prompt_logprobs set: one per prompt token, the first's logprob None (nothing scores it), on the first token's output
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Request:
    request_id: str  # (None only while Engine.add_requests checks a request it is to name)
    prompt_ids: list[int]
    config: GenerationConfig
    seed: int  # the user's seed, or one drawn at arrival
    t_arrival: float
    detokenizer: IncrementalDetokenizer
    drafter: Drafter | None  # this request's own drafter (None: plain decoding)
    drafter_name: str
    k_policy: AdaptiveK  # fixed or adaptive K
    stats: AcceptanceStats | None
    sequential_generator: torch.Generator | None  # rejection sampling against a drafter's q (engine.verifier)
    processor: LogitsProcessor | None = None  # its logits processors and grammar state (None: none set)
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    max_blocks: int = 0  # the most blocks it can ever hold (a request under a KV policy reserves them when admitted)
    kv: KVState | None = None  # its KV policy's state (fastdecode.kv.policy); None: the full cache
    num_computed: int = 0  # leading context positions whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    new_tokens: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    t_first: float | None = None
    t_end: float | None = None
    result: GenerationResult | None = None
    drafts_in_target_kv: bool = False  # its drafter writes draft rows in this request's blocks (Drafter.attach_kv)
    decode_passes: int = 0  # target passes of its decode steps (GenerationResult says more)
    decode_pass_s: float = 0.0
    draft_s: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token, when config.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # filled while prefilling
    guard: SpeculationGuard | None = None  # stops its drafting while it does not pay (DraftPlanner.begin)
    num_preemptions: int = 0  # times the scheduler took its blocks back (for older requests, or its slot for a new one)
    num_tokens_at_admission: int = 0  # len(new_tokens) when it was last admitted: its turn starts there

    def __post_init__(self) -> None:
        self.context = list(self.prompt_ids)

    @property
    def has_tokens(self) -> bool:
        """Whether it has generated tokens (waiting or prefilling, it was preempted: it refills its cache)."""
        return bool(self.new_tokens)

    @property
    def turn_tokens(self) -> int:
        """Tokens generated since it was last admitted (the scheduler's time slices)."""
        return len(self.new_tokens) - self.num_tokens_at_admission

    @property
    def fill_ids(self) -> list[int]:
        """The tokens a prefill feeds before decoding: its prompt (the last chunk's logits give the first
        token) or, after a preemption, its context but the last token (recomputed, no logits: the
        tokens it has are kept, and the last is fed by its next decode step)."""
        return self.context[:-1] if self.new_tokens else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        """Its cache is still being filled: no token yet, or resumed and not yet caught up."""
        return not self.new_tokens or self.num_computed < len(self.context) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
