"""The speculation guard (fastdecode.engine.guard): a request whose drafts do not pay stops
drafting after a bounded number of steps, probing again now and then; one whose drafts pay
keeps drafting; its tokens are plain decoding's either way.

The pass costs are a fixed line (``linear_pass_costs``: T(rows) = 1 + rows / 100): on the
tiny model whether a draft pays is a matter of timing noise."""

from __future__ import annotations

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.engine.guard import GuardStep, SpeculationGuard

PROMPT = [1] + [20, 21, 22, 23] * 6
NEW_TOKENS = 100


def _decode(engine: Engine, **options):
    """Run one request to the end; returns (its result, its request object)."""
    request_id = engine.add_request(PROMPT, max_new_tokens=NEW_TOKENS, **options)
    request = engine.get_request(request_id)
    while engine.has_unfinished():
        engine.step()
    return request.result, request


@pytest.fixture
def plain(tiny_model, tokenizer):
    return Engine(tiny_model, tokenizer).generate(PROMPT, max_new_tokens=NEW_TOKENS)


def test_drafts_that_never_pay_stop_after_a_bounded_number_of_steps(
    tiny_model, tokenizer, oracle_drafter, linear_pass_costs, plain
):
    wrong = oracle_drafter(PROMPT + plain.token_ids, corrupt=lambda step, i: True)  # every draft token wrong
    result, request = _decode(Engine(tiny_model, tokenizer, drafter=wrong), draft_k=4)
    assert result.token_ids == plain.token_ids
    steps = len(result.token_ids)
    assert steps >= 90
    # WARMUP_STEPS steps before the first verdict, one after timing the plain pass, then probes of
    # 4 steps (of one token) after each pause, a pause at least twice the last
    g = SpeculationGuard
    assert len(wrong.requested_k) <= g.WARMUP_STEPS + 1 + 2 * g.PROBE_STEPS
    assert request.guard.num_pauses >= 2
    assert request.guard.num_paused_steps >= steps - len(wrong.requested_k) - 1


def test_drafts_that_pay_keep_drafting(tiny_model, tokenizer, oracle_drafter, linear_pass_costs, plain):
    right = oracle_drafter(PROMPT + plain.token_ids)  # every draft token right
    result, request = _decode(Engine(tiny_model, tokenizer, drafter=right), draft_k=4)
    assert result.token_ids == plain.token_ids
    assert request.guard.num_pauses == 0
    # only the plain pass was timed once (alone, never measured), for MIN_SAMPLES steps
    assert request.guard.num_paused_steps == request.guard.min_plain_samples
    assert result.acceptance.steps >= len(result.token_ids) // 5 - 1


def test_without_the_guard_a_request_drafts_whatever_it_costs(
    tiny_model, tokenizer, oracle_drafter, linear_pass_costs, plain
):
    wrong = oracle_drafter(PROMPT + plain.token_ids, corrupt=lambda step, i: True)
    result, request = _decode(Engine(tiny_model, tokenizer, drafter=wrong), draft_k=4, speculation_guard=False)
    assert result.token_ids == plain.token_ids and request.guard is None
    assert len(wrong.requested_k) >= len(result.token_ids) - 2  # (the first token comes from the prompt pass)


def test_a_guarded_sampled_request_gives_plain_sampling_tokens(tiny_model, tokenizer, linear_pass_costs):
    # n-gram drafts verified by matching: position-keyed sampling gives plain's tokens whatever the draft lengths
    options = {"max_new_tokens": NEW_TOKENS, "temperature": 0.9, "seed": 11}
    plain = Engine(tiny_model, tokenizer).generate(PROMPT, **options)
    spec = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram")).generate(PROMPT, **options)
    assert spec.token_ids == plain.token_ids


def _steps(guard: SpeculationGuard, cost, count: int, accepted: int = 0, k: int = 4) -> list[int | None]:
    """``count`` decode steps of a request alone whose drafts of k tokens (or the guard's limit)
    get ``accepted`` tokens accepted; returns the guard's limit at each step."""
    limits = []
    for _ in range(count):
        limit = guard.max_draft()
        limits.append(limit)
        drafted = k if limit is None else min(k, limit)
        if drafted:
            step = GuardStep(min(accepted, drafted) + 1, 1 + drafted, drafted, 0.00025 * drafted)
            guard.record(step, cost, lambda rows: True, alone=True)
    return limits


def test_a_probe_drafts_one_token_and_costs_at_most_its_share_of_the_pause_before_it():
    cost = lambda rows: 0.010 * (1 + 0.5 * (rows - 1))  # noqa: E731 (a pass of 5 rows costs 3x a plain one)
    g = SpeculationGuard
    guard = SpeculationGuard()
    # the plan's length until the verdict: after WARMUP_STEPS, at once where nothing was accepted
    assert _steps(guard, cost, g.WARMUP_STEPS, accepted=1) == [None] * g.WARMUP_STEPS
    assert guard.num_pauses == 1 and guard.paused >= g.MIN_PAUSE_STEPS
    # the probe at its worst: nothing accepted, judged after FAST_VERDICT_STEPS steps of PROBE_K rows; at most
    # PROBE_LOSS of the pause
    probe_loss = g.FAST_VERDICT_STEPS * (cost(1 + g.PROBE_K) - cost(1) + 0.00025 * g.PROBE_K)
    assert probe_loss <= g.PROBE_LOSS * guard.paused * cost(1) + 1e-12
    pause = guard.paused
    limits = _steps(guard, cost, pause + g.FAST_VERDICT_STEPS)
    assert limits == [0] * pause + [g.PROBE_K] * g.FAST_VERDICT_STEPS  # nothing accepted: judged early
    assert guard.num_pauses == 2 and guard.paused >= min(2 * pause, g.MAX_PAUSE_STEPS)  # a probe that lost: longer
    # a request whose drafts pay again after the pause (the text turned repetitive) resumes its full length
    limits = _steps(guard, cost, guard.paused + g.PROBE_STEPS + 20, accepted=4)
    assert limits[-20:] == [None] * 20
    assert guard.num_pauses == 2 and guard.paused == 0


def test_a_prompt_whose_drafts_never_pay_loses_a_bounded_share_of_its_time():
    """Counting rows, not seconds: over 96 steps of a request whose drafts of 3 tokens are never
    accepted, the draft rows it paid for cost at most 3% of plain decoding's time (GGUF-like
    costs: a row 0.23 of a 1-row pass, the dearest measured)."""
    cost = lambda rows: 0.004 * (1 + 0.23 * (rows - 1))  # noqa: E731
    guard = SpeculationGuard()
    limits = _steps(guard, cost, 96, accepted=0, k=3)
    rows = sum(3 if limit is None else min(3, limit) for limit in limits)
    extra_s = sum(cost(1 + (3 if limit is None else min(3, limit))) - cost(1) for limit in limits)
    g = SpeculationGuard
    assert rows <= g.FAST_VERDICT_STEPS * (3 + g.PROBE_K)  # the warm-up's drafts, then one probe of 1-token steps
    assert extra_s <= 0.03 * 96 * cost(1)


def test_the_guard_is_an_engine_option_with_a_flag():
    import argparse

    from fastdecode.args import EngineArgs
    from fastdecode.errors import ConfigError

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), groups=("drafter",))
    on = EngineArgs.from_cli_args(parser.parse_args(["--drafter", "ngram"]))
    off = EngineArgs.from_cli_args(parser.parse_args(["--drafter", "ngram", "--no-speculation-guard"]))
    assert on.generation_config().speculation_guard and not off.generation_config().speculation_guard
    with pytest.raises(ConfigError, match="choose a --drafter"):
        EngineArgs(speculation_guard=False).validate()


def test_drafts_never_accepted_pause_whatever_a_noisy_cost_table_says():
    """A busy moment can leave T(4 rows) measured below T(1); a window with nothing accepted still
    pauses: it gained one token a step, as plain decoding does, in wider passes."""
    inverted = lambda rows: 0.010 if rows == 1 else 0.009  # noqa: E731
    guard = SpeculationGuard()
    limits = _steps(guard, inverted, SpeculationGuard.FAST_VERDICT_STEPS + 1, accepted=0, k=3)
    assert limits[: SpeculationGuard.FAST_VERDICT_STEPS] == [None] * SpeculationGuard.FAST_VERDICT_STEPS
    assert limits[-1] == 0 and guard.num_pauses == 1
    guard = SpeculationGuard()
    _steps(guard, lambda rows: 0.0, SpeculationGuard.FAST_VERDICT_STEPS, accepted=0)  # nothing measured yet
    assert guard.num_pauses == 1 and guard.paused == SpeculationGuard.MIN_PAUSE_STEPS


def test_pauses_double_up_to_a_cap_so_a_later_burst_of_repetition_is_caught():
    cost = lambda rows: 0.010 * (1 + 0.11 * (rows - 1))  # noqa: E731 (float32-like rows: the bound asks for little)
    g = SpeculationGuard
    guard = SpeculationGuard()
    pauses = []
    for _ in range(6):
        _steps(guard, cost, g.FAST_VERDICT_STEPS if not pauses else guard.paused + g.FAST_VERDICT_STEPS, k=3)
        pauses.append(guard.paused)
    assert pauses == [21, 42, 64, 64, 64, 64]  # (the first: 2% of its plain time pays for a probe's 3 rows)
    _steps(guard, cost, guard.paused + g.PROBE_STEPS + 8, accepted=3)  # the text turned repetitive: a probe sees it
    assert guard.paused == 0 and guard.max_draft() is None
