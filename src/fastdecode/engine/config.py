"""A request's generation options, and the draft-length policy they choose.

K is ANPD's: the number of tokens drafted per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fastdecode.decoding.logits_process import ProcessingParams
from fastdecode.decoding.sampling import SamplingParams
from fastdecode.engine.logprobs import MAX_LOGPROBS
from fastdecode.errors import ConfigError
from fastdecode.kv.policy import KVPolicy


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    processing: ProcessingParams = field(default_factory=ProcessingParams)  # penalties, bias, min_tokens, grammar
    stop: tuple[str, ...] = ()
    draft_k: int = 7  # K: tokens drafted per step (the initial value when adaptive)
    adaptive_k: bool = False
    cost_aware_k: bool = (
        False  # choose K each step from measured pass cost and acceptance (BatchDraftPolicy), batch 1 too
    )
    max_draft_k: int | None = None  # upper bound for adaptive K; default 2 * draft_k
    speculate: bool = True  # False: this request decodes plainly even when the engine has a drafter
    # Candidate paths per step: 1 = one chain (ANPD); N > 1 = the chain and up to N - 1 alternative
    # paths verified in the same pass; "auto" = up to DraftPlanner.AUTO_DRAFT_PATHS, each only while it pays.
    draft_tree: int | str = 1
    # Log-probabilities (fastdecode.engine.logprobs): None = none; N = each generated (prompt)
    # token's with its N most likely alternatives (0: the token's alone).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Stop drafting while this request's speculation measures slower than plain decoding would be,
    # probing again now and then (fastdecode.engine.guard). Off: draft whatever it costs (benchmarks of a drafter).
    speculation_guard: bool = True
    # What the request's KV cache keeps once full (fastdecode.kv.policy): "full", "sinks[:S[,W]]",
    # "h2o[:BUDGET[,RECENT[,SINKS[,EVICT]]]]" or a KVPolicy; past the context window only a policy keeps generating.
    kv_policy: KVPolicy | str = "full"

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_int(self.draft_k) or self.draft_k < 1:
            raise ConfigError(f"draft_k must be an integer >= 1, got {self.draft_k!r}")
        if self.max_draft_k is not None and (not _is_int(self.max_draft_k) or self.max_draft_k < self.draft_k):
            raise ConfigError(f"max_draft_k must be an integer >= draft_k ({self.draft_k}), got {self.max_draft_k!r}")
        if self.adaptive_k and self.cost_aware_k:
            raise ConfigError("choose one draft length policy: adaptive_k or cost_aware_k")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.processing, ProcessingParams):
            raise ConfigError(f"processing must be a ProcessingParams, got {type(self.processing).__name__}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
        if not isinstance(self.speculate, bool):
            raise ConfigError(f"speculate must be true or false, got {self.speculate!r}")
        if not isinstance(self.speculation_guard, bool):
            raise ConfigError(f"speculation_guard must be true or false, got {self.speculation_guard!r}")
        if self.draft_tree != "auto" and (not _is_int(self.draft_tree) or self.draft_tree < 1):
            raise ConfigError(f"draft_tree must be 'auto' or an integer >= 1 (paths per step), got {self.draft_tree!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        object.__setattr__(self, "kv_policy", KVPolicy.parse(self.kv_policy))

    @classmethod
    def from_options(cls, base: GenerationConfig | None = None, **options) -> GenerationConfig:
        """Build from flat keyword options (``temperature=``, ``draft_k=``, ``frequency_penalty=``,
        ``grammar=``, ...); an unknown option is an error, never silently dropped."""
        base = base or cls()
        sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
        processing_fields = {f.name for f in dataclasses.fields(ProcessingParams)}
        own_fields = {f.name for f in dataclasses.fields(cls)} - {"sampling", "processing"}
        unknown = set(options) - sampling_fields - processing_fields - own_fields
        if unknown:
            raise ConfigError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        sampling = dataclasses.replace(base.sampling, **{k: v for k, v in options.items() if k in sampling_fields})
        processing = base.processing
        if set(options) & processing_fields:
            processing = dataclasses.replace(processing, **{k: v for k, v in options.items() if k in processing_fields})
        return dataclasses.replace(
            base, sampling=sampling, processing=processing, **{k: v for k, v in options.items() if k in own_fields}
        )


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
