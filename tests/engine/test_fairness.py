"""Time slices of the running slots (``time_slice_tokens``, ``engine/scheduler.py``): no request can
starve the others (issue 42).

The hog of issue 42 (three sequences that decode for a long time) holds 3 of 8 slots; 8 clients with
ordinary requests (64 new tokens) arrive while it runs. First come, first served, three of them wait
until another client's 64 tokens are done; with time slices, each client's first token comes within
the steps it takes without the hog. Time is counted in engine steps, never on the clock. Every
request still gets the tokens it gets alone (greedy and seeded sampling, with and without a drafter),
the hog included, and every block is back in the pool at the end."""

from __future__ import annotations

import pytest
from tiny_models import tiny_llama

from fastdecode import Engine, GenerationConfig, build_drafter
from fastdecode.errors import ConfigError

CONTEXT = 1024
HOG_PROMPT = [1, 9, 17, 33, 41, 12, 5]
HOG_TOKENS = 200  # each of its 3 sequences
CLIENT_PROMPTS = [[1, *range(10 + 3 * i, 22 + 3 * i)] for i in range(8)]
CLIENT_TOKENS = 64
SLICE = 32
HOG_HEAD_START = 40  # tokens each hog sequence has when the clients arrive
# Drafting whatever it costs: the speculation guard's choices follow the clock, the steps here must not.
NO_GUARD = GenerationConfig(speculation_guard=False)


@pytest.fixture(scope="module")
def long_model():
    """The tiny Llama with a 1,024-token context, so that the hog runs for hundreds of steps."""
    return tiny_llama(0, max_position_embeddings=CONTEXT, eos_token_id=2, bos_token_id=1)


def _hog_specs(sampled: bool, **extra) -> list[dict]:
    options = dict(max_new_tokens=HOG_TOKENS, min_tokens=HOG_TOKENS, **extra)  # no early end
    if sampled:
        options.update(temperature=0.9, top_k=30)
    return [dict(prompt=HOG_PROMPT, **options, **({"seed": 7 + n} if sampled else {})) for n in range(3)]


def _client_specs(sampled: bool) -> list[dict]:
    specs = []
    for i, prompt in enumerate(CLIENT_PROMPTS):
        spec = dict(prompt=prompt, max_new_tokens=CLIENT_TOKENS)
        if sampled:
            spec.update(temperature=0.8, seed=100 + i)
        specs.append(spec)
    return specs


def _drafter(kind: str | None, model=None):
    """None, the n-gram drafter, or the target drafting for itself in its own cache (Drafter.attach_kv)."""
    if kind == "self":
        return build_drafter("draft-model", model=model, k=3)
    return None if kind is None else build_drafter("ngram", n=2, k=5)


class Run:
    """Drives an engine step by step: each request's tokens, and the step of each one's first token."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.steps = engine, 0
        self.tokens: dict[str, list[int]] = {}
        self.arrival: dict[str, int] = {}
        self.first: dict[str, int] = {}

    def add(self, specs: list[dict]) -> list[str]:
        ids = self.engine.add_requests(specs)
        for request_id in ids:
            self.tokens[request_id], self.arrival[request_id] = [], self.steps
        return ids

    def step(self) -> None:
        self.steps += 1
        for out in self.engine.step():
            if out.token_ids and out.request_id not in self.first:
                self.first[out.request_id] = self.steps
            self.tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                assert out.result.token_ids == self.tokens[out.request_id]

    def finish(self, limit: int = 5000) -> None:
        while self.engine.has_unfinished() and self.steps < limit:
            self.step()
        assert not self.engine.has_unfinished(), f"still running after {limit} steps"

    def steps_to_first_token(self, ids: list[str]) -> list[int]:
        """Steps from each request's arrival to the step that gave its first token (1: the next step)."""
        return [self.first[i] - self.arrival[i] for i in ids]


def _alone(model, tokenizer, drafter, specs: list[dict]) -> list[list[int]]:
    engine = Engine(
        model, tokenizer, drafter=_drafter(drafter, model), max_num_seqs=1, enable_prefix_caching=False, config=NO_GUARD
    )
    return [engine.generate(s["prompt"], **{k: v for k, v in s.items() if k != "prompt"}).token_ids for s in specs]


@pytest.fixture(scope="module")
def alone(long_model, tokenizer):
    """``_alone`` of (drafter, specs), each run once in the module (a thousand single-request steps)."""
    runs: dict[tuple, list[list[int]]] = {}

    def tokens(drafter, specs: list[dict]) -> list[list[int]]:
        key = (drafter, repr(specs))
        if key not in runs:
            runs[key] = _alone(long_model, tokenizer, drafter, specs)
        return runs[key]

    return tokens


def _clients_beside_the_hog(model, tokenizer, drafter, sampled, time_slice_tokens) -> tuple[Run, list, list]:
    engine = Engine(
        model, tokenizer, drafter=_drafter(drafter, model), max_num_seqs=8, time_slice_tokens=time_slice_tokens
    )
    run = Run(engine)
    hog = run.add(_hog_specs(sampled))
    while min(len(run.tokens[i]) for i in hog) < HOG_HEAD_START:
        run.step()
    clients = run.add(_client_specs(sampled))
    run.finish()
    return run, hog, clients


def _clients_alone(model, tokenizer, drafter, sampled) -> list[int]:
    run = Run(
        Engine(
            model, tokenizer, drafter=_drafter(drafter, model), max_num_seqs=8, time_slice_tokens=SLICE, config=NO_GUARD
        )
    )
    clients = run.add(_client_specs(sampled))
    run.finish()
    return run.steps_to_first_token(clients)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", [None, "ngram", "self"])
def test_the_hog_holds_no_client_back_and_every_output_is_the_same(long_model, tokenizer, alone, sampled, drafter):
    without_hog = _clients_alone(long_model, tokenizer, drafter, sampled)
    run, hog, clients = _clients_beside_the_hog(long_model, tokenizer, drafter, sampled, SLICE)
    with_hog = run.steps_to_first_token(clients)
    # issue 42's target is p99 within 3x of without the hog; in steps, each client's first token comes as soon
    assert max(with_hog) <= 3 * max(without_hog), (with_hog, without_hog)
    assert with_hog == without_hog
    assert run.engine.scheduler.num_yields == 3  # the hog's three sequences, one slot each
    # the tokens each request gets alone: the hog's too, though each of its sequences yielded and resumed.
    # Alone without a drafter, but where the drafter samples a q of its own: greedy, every drafter's
    # tokens are plain decoding's, and seeded, the n-gram drafter's are plain sampling's (verified by
    # matching, the draws keyed by position), so one reference serves them all.
    reference = drafter if sampled and drafter == "self" else None
    assert [run.tokens[i] for i in clients] == alone(reference, _client_specs(sampled))
    assert [run.tokens[i] for i in hog] == alone(reference, _hog_specs(sampled))
    assert all(len(run.tokens[i]) == HOG_TOKENS for i in hog)
    pool = run.engine.block_pool
    assert pool.num_free == pool.num_blocks and all(c == 0 for c in pool.ref_count)


def test_first_come_first_served_makes_three_clients_wait_for_a_whole_request(long_model, tokenizer):
    """What time slices fix: without them, three clients wait for another client's 64 tokens."""
    run, _, clients = _clients_beside_the_hog(long_model, tokenizer, None, False, None)
    with_hog = sorted(run.steps_to_first_token(clients))
    assert with_hog == [1] * 5 + [CLIENT_TOKENS + 1] * 3  # the first clients' 64 tokens, then a step
    assert run.engine.scheduler.num_yields == 0


def test_a_client_arriving_early_waits_at_most_a_time_slice(long_model, tokenizer):
    """Clients that arrive before the hog's turn reaches the slice wait for it, and no longer."""
    engine = Engine(long_model, tokenizer, max_num_seqs=8, time_slice_tokens=SLICE)
    run = Run(engine)
    run.add(_hog_specs(False))
    for _ in range(5):
        run.step()
    clients = run.add(_client_specs(False))
    run.finish()
    # the hog's sequences had 5 tokens when the clients came: 27 more and they yield, a step later the first tokens
    assert sorted(run.steps_to_first_token(clients)) == [1] * 5 + [SLICE - 5 + 1] * 3
    assert engine.scheduler.num_yields == 3


def test_a_hog_among_a_stream_of_clients_still_finishes_the_same(long_model, tokenizer, alone):
    """No starvation: clients keep arriving for as long as the hog runs, in a pool small enough that
    requests are also preempted for blocks; the hog yields again and again, makes progress each
    time it is readmitted, and finishes with the tokens it gets alone, as does every client."""
    engine = Engine(long_model, tokenizer, max_num_seqs=4, time_slice_tokens=16, block_size=4, num_kv_blocks=100)
    run = Run(engine)
    hog = run.add(_hog_specs(True))  # sampled: three different sequences (greedy ones would share their blocks)
    clients, specs = [], []
    while any(i in engine._requests for i in hog):
        if run.steps % 6 == 0:
            spec = dict(prompt=CLIENT_PROMPTS[len(specs) % 8][: 6 + len(specs) % 7], max_new_tokens=12, min_tokens=12)
            specs.append(spec)
            clients += run.add([spec])
        run.step()
        assert run.steps < 3000, "the hog is starved"
    run.finish()
    yields = engine.scheduler.num_yields
    assert yields > 3 and engine.scheduler.num_preemptions > yields  # both kinds happened
    assert [run.tokens[i] for i in hog] == alone(None, _hog_specs(True))
    assert [run.tokens[i] for i in clients] == alone(None, specs)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_request_under_a_kv_policy_never_yields(long_model, tokenizer):
    """Its cache cannot be recomputed (its policy evicted tokens), so it is never preempted: with the
    hog's sequences under a policy, the one free slot is shared by time slices between the clients."""
    engine = Engine(long_model, tokenizer, max_num_seqs=4, time_slice_tokens=8)
    run = Run(engine)
    hog = [engine.get_request(i) for i in run.add(_hog_specs(False, kv_policy="sinks:4,60"))]
    for _ in range(20):
        run.step()
    clients = run.add(_client_specs(False)[:2])
    run.finish()
    assert all(r.num_preemptions == 0 and len(r.new_tokens) == HOG_TOKENS for r in hog)
    assert engine.scheduler.num_yields >= 1  # the first client's turn, for the second
    assert sorted(run.steps_to_first_token(clients)) == [1, 9]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_time_slice_tokens_must_be_a_positive_integer(tiny_model, tokenizer, bad):
    with pytest.raises(ConfigError, match="time_slice_tokens"):
        Engine(tiny_model, tokenizer, time_slice_tokens=bad)
