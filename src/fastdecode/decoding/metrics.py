"""Per-request results and acceptance statistics.

Conventions, stated once:

* a **step** is one verification forward pass of the target; the first token,
  produced by prefill, belongs to no step;
* **alpha** (acceptance rate) = accepted draft tokens / drafted tokens;
* **tau** (mean tokens per step) = tokens appended by steps / steps, *counting
  the bonus token* (as vLLM does), so plain decoding has tau = 1;
* **per_position_acceptance[i]** = of the steps that drafted at least i + 1
  tokens, the fraction whose draft token i was accepted;
* **alpha_k_bound** = alpha * K + 1, the ANPD paper's bound on tokens per step,
  with K the configured draft length.

With several candidate paths per step (``draft_tree``), **drafted** counts every
draft token verified: the nodes of the token tree, the main chain and the nodes
its alternatives add (a prefix an alternative shares with an earlier path is one
set of nodes, verified once); ``nodes_per_step`` is their mean. **accepted** counts
the accepted tokens of the path kept, and per-position acceptance follows the main
chain; ``alternative_wins`` counts the steps an alternative path was kept,
``alternative_extra_tokens`` what it added over the main chain.

**by_source** (drafters that name where each token came from, ``Draft.sources``):
per source, the main-chain tokens drafted, *reached* (every token before them
accepted) and accepted; accepted / reached is the source's acceptance rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


def conditional_estimates(
    accepted: Sequence[int], reached: Sequence[int], k_max: int, prior: float = 0.5
) -> list[float]:
    """c_i = (accepted_i + 2 p) / (reached_i + 2) for positions i < k_max, where reached_i counts
    the drafts that had position i with every earlier one accepted: smoothed towards p, the
    request's pooled rate over all positions ((sum accepted + 2 prior) / (sum reached + 2), with
    ``prior`` the drafter's rate over earlier requests, 1/2 before any). A position never reached
    takes the rate the others show, so a drafter whose tokens are accepted 95% of the time (the
    target's own low-bit blocks drafting) is not held to drafts of one or two tokens by a fixed
    prior of 1/2 for positions it was never given, nor made to learn that again in each request.

    >>> [round(c, 3) for c in conditional_estimates([9, 0], [10, 0], 3)]
    [0.889, 0.833, 0.833]
    >>> [round(c, 3) for c in conditional_estimates([], [], 2, prior=0.9)]
    [0.9, 0.9]
    """
    p = (sum(accepted) + 2 * prior) / (sum(reached) + 2)
    return [
        ((accepted[i] if i < len(accepted) else 0) + 2 * p) / ((reached[i] if i < len(reached) else 0) + 2)
        for i in range(k_max)
    ]


@dataclass
class AcceptanceStats:
    draft_k: int
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    step_tokens: int = 0  # tokens steps appended to the output, bonus tokens included (not those past a stop)
    alternative_tokens: int = 0  # tree nodes off the main chain (included in drafted_tokens)
    alternative_wins: int = 0
    alternative_extra_tokens: int = 0
    _drafted_at: list[int] = field(default_factory=list, repr=False)
    _accepted_at: list[int] = field(default_factory=list, repr=False)
    _reached_at: list[int] = field(default_factory=list, repr=False)  # drafted with every earlier position accepted
    prior_rate: float = field(default=0.5, repr=False)  # the drafter's conditional rate over earlier requests
    _by_source: dict[str, list[int]] = field(default_factory=dict, repr=False)  # source -> [drafted, reached, accepted]

    def record(
        self,
        num_drafted: int,
        num_accepted: int,
        num_appended: int,
        num_alternative_tokens: int = 0,
        main_accepted: int | None = None,
    ) -> None:
        """One step: ``num_drafted`` main-chain tokens of which the kept path accepted
        ``num_accepted`` (the main chain itself ``main_accepted``, default the same)."""
        main_accepted = num_accepted if main_accepted is None else main_accepted
        self.steps += 1
        self.drafted_tokens += num_drafted + num_alternative_tokens
        self.accepted_tokens += num_accepted
        self.step_tokens += num_appended
        self.alternative_tokens += num_alternative_tokens
        if num_accepted > main_accepted:
            self.alternative_wins += 1
            self.alternative_extra_tokens += num_accepted - main_accepted
        while len(self._drafted_at) < num_drafted:
            self._drafted_at.append(0)
            self._accepted_at.append(0)
            self._reached_at.append(0)
        for i in range(num_drafted):
            self._drafted_at[i] += 1
            self._reached_at[i] += i <= main_accepted
            self._accepted_at[i] += i < main_accepted

    def record_sources(self, sources: Sequence[str], num_accepted: int) -> None:
        """The main chain's sources, one per drafted token, and how many of it were accepted: a
        token is *reached* when every token before it was accepted (it was then accepted or was
        the first rejected)."""
        for i, source in enumerate(sources):
            counts = self._by_source.setdefault(source, [0, 0, 0])
            counts[0] += 1
            if i <= num_accepted:
                counts[1] += 1
                counts[2] += i < num_accepted

    def source_acceptance(self, source: str) -> float:
        """P(a token from ``source`` is accepted | reached), Laplace-smoothed (unseen: 1/2)."""
        _, reached, accepted = self._by_source.get(source, (0, 0, 0))
        return (accepted + 1) / (reached + 2)

    @property
    def by_source(self) -> dict[str, dict[str, int]]:
        return {s: {"drafted": d, "reached": r, "accepted": a} for s, (d, r, a) in sorted(self._by_source.items())}

    @property
    def alpha(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tau(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def nodes_per_step(self) -> float:
        return self.drafted_tokens / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d for a, d in zip(self._accepted_at, self._drafted_at)]

    def conditional_totals(self) -> tuple[int, int]:
        """(main-chain tokens accepted, main-chain positions reached) over every position: the
        counts the conditional rates come from (an engine pools them across requests)."""
        return sum(self._accepted_at), sum(self._reached_at)

    def conditional_acceptance(self, k_max: int) -> list[float]:
        """c_i = P(main-chain position i accepted | positions < i were), i < k_max
        (``conditional_estimates``). The chance of a draft's first j tokens all being
        accepted is c_0 * .. * c_(j-1) (per_position_acceptance is already that product)."""
        return conditional_estimates(self._accepted_at, self._reached_at, k_max, self.prior_rate)

    @property
    def alpha_k_bound(self) -> float:
        return self.alpha * self.draft_k + 1

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.alpha,
            "mean_tokens_per_step": self.tau,
            "nodes_per_step": self.nodes_per_step,
            "tau_counts_bonus_token": True,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_k": self.draft_k,
            "alpha_k_bound": self.alpha_k_bound,
            "alternative_tokens": self.alternative_tokens,
            "alternative_wins": self.alternative_wins,
            "alternative_extra_tokens": self.alternative_extra_tokens,
            "by_source": self.by_source,
        }


@dataclass
class GenerationResult:
    """What one request produced. Times in seconds, measured by the engine."""

    token_ids: list[int]  # new tokens only
    text: str
    num_prompt_tokens: int
    num_new_tokens: int
    ttft_s: float  # call -> first new token (tokenization and prefill)
    decode_tokens_per_s: float  # tokens after the first / time after the first
    wall_s: float
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    drafter: str  # "none" for plain decoding
    acceptance: AcceptanceStats | None
    num_cached_prompt_tokens: int = 0  # prompt positions whose KV came from the prefix cache
    # The cost of its decode steps: the target passes that verified them (a pass shared with
    # other requests counts whole for each: the time this request waited for it), and the
    # time its drafter took proposing. Prefill passes are not counted.
    decode_passes: int = 0
    decode_pass_s: float = 0.0
    draft_s: float = 0.0
    # fastdecode.engine.logprobs.TokenLogprob entries, when the request asked for them
    logprobs: list | None = None  # one per new token
    prompt_logprobs: list | None = None  # one per prompt token, the first's logprob None

    @property
    def pass_ms(self) -> float:
        """Mean milliseconds of a decode step's target pass (0 with none)."""
        return 1000 * self.decode_pass_s / self.decode_passes if self.decode_passes else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance"] = None if self.acceptance is None else self.acceptance.to_dict()
        return out
