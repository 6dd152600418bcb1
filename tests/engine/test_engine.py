"""The decode loop on a tiny random-weight Llama.

Losslessness is checked token for token against plain decoding (and plain
decoding against ``model.generate``); the oracle drafter of ``conftest`` makes
every accept pattern, and so every KV-cache rollback, known in advance.
"""

from __future__ import annotations

import pytest
import torch
from stats_helpers import DraftToTheCaps, binned_chisquare_pvalue, generate_per_seed

from fastdecode import Engine, GenerationConfig, build_drafter
from fastdecode.decoding.sampling import SamplingParams, probabilities
from fastdecode.drafters.base import Draft, Drafter
from fastdecode.engine import AdaptiveK
from fastdecode.errors import ConfigError, PromptTooLongError

PROMPT_RANDOM = [1, 40, 71, 9, 55, 23, 88, 14]
PROMPT_REPEAT = [1] + [20, 21, 22, 23] * 6  # a repeated pattern: n-gram drafters find matches
PROMPT_ONE = [1]
PROMPTS = {"random": PROMPT_RANDOM, "repeat": PROMPT_REPEAT, "one-token": PROMPT_ONE}
MAX_NEW = 48
CONTEXT_LENGTH = 128  # the tiny model's max_position_embeddings (checked below)
EOS_ID = 2


@pytest.fixture(scope="module")
def plain_results(tiny_model, tokenizer):
    """Plain greedy decoding of each prompt: the reference every drafter must match."""
    engine = Engine(tiny_model, tokenizer)
    return {name: engine.generate(prompt, max_new_tokens=MAX_NEW) for name, prompt in PROMPTS.items()}


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def collect(stream):
    steps = list(stream)
    return steps, stream.result


# --- plain decoding against transformers ------------------------------------


@pytest.mark.parametrize("name", list(PROMPTS))
def test_plain_greedy_equals_hf_generate(tiny_model, tokenizer, plain_results, name):
    expected = hf_greedy(tiny_model, PROMPTS[name], MAX_NEW, EOS_ID)
    result = plain_results[name]
    assert result.token_ids == expected
    assert result.num_new_tokens == len(expected)
    assert result.num_prompt_tokens == len(PROMPTS[name])
    if expected[-1] == EOS_ID:
        assert result.finish_reason == "eos"
    else:
        assert len(expected) == MAX_NEW and result.finish_reason == "length"
    assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert result.drafter == "none" and result.acceptance is None


def test_fixture_constants(tiny_model, tokenizer):
    assert tiny_model.config.max_position_embeddings == CONTEXT_LENGTH
    assert tokenizer.eos_token_id == tiny_model.config.eos_token_id == EOS_ID


def test_reference_outputs_cover_both_stop_kinds(plain_results):
    # Guards the fixture: the prompts must exercise EOS and the length limit.
    reasons = {r.finish_reason for r in plain_results.values()}
    assert reasons == {"eos", "length"}


def test_text_prompt_is_tokenized_and_decoded(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer)
    prompt = "the cat sat on the mat; the cat sat on the"
    result = engine.generate(prompt, max_new_tokens=20)
    assert result.num_prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert result.token_ids == engine.generate(tokenizer(prompt)["input_ids"], max_new_tokens=20).token_ids
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)


# --- greedy losslessness of every drafter -----------------------------------


NGRAM_SETTINGS = [
    dict(drafter={}, gen={}),
    dict(drafter=dict(n=2), gen=dict(draft_k=1)),
    dict(drafter=dict(n=3), gen=dict(draft_k=3)),
    dict(drafter=dict(n=5), gen=dict(draft_k=12)),
    dict(drafter=dict(n=4), gen=dict(draft_k=2, adaptive_k=True)),
    dict(drafter=dict(n=5), gen=dict(draft_k=7, adaptive_k=True, max_draft_k=20)),
    dict(drafter=dict(n=3, min_count=2), gen=dict(draft_k=5)),
    dict(drafter=dict(n=3, min_prob=0.6), gen=dict(draft_k=5)),
    dict(drafter=dict(n=5, min_count=2, min_prob=0.5), gen=dict(draft_k=4, adaptive_k=True)),
]


@pytest.mark.parametrize("setting", NGRAM_SETTINGS, ids=lambda s: f"{s['drafter']}-{s['gen']}")
@pytest.mark.parametrize("name", list(PROMPTS))
def test_ngram_greedy_equals_plain(tiny_model, tokenizer, plain_results, name, setting):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", **setting["drafter"]))
    result = engine.generate(PROMPTS[name], max_new_tokens=MAX_NEW, **setting["gen"])
    expected = plain_results[name]
    assert result.token_ids == expected.token_ids
    assert result.text == expected.text
    assert result.finish_reason == expected.finish_reason
    assert result.drafter == "ngram"


@pytest.mark.parametrize("setting", NGRAM_SETTINGS, ids=lambda s: f"{s['drafter']}-{s['gen']}")
def test_ngram_drafts_and_gets_accepted_on_repeated_pattern(tiny_model, tokenizer, setting):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", **setting["drafter"]))
    # (the subject is drafting, not whether it pays on the tiny model: the guard would decide that by timing noise)
    stats = engine.generate(PROMPT_REPEAT, max_new_tokens=MAX_NEW, speculation_guard=False, **setting["gen"])
    stats = stats.acceptance
    assert stats.drafted_tokens > 0
    assert 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert stats.tau > 1.0  # accepted drafts mean fewer steps than tokens


@pytest.mark.parametrize("options", [{}, dict(max_ngram_size=3), dict(max_ngram_size=1)])
@pytest.mark.parametrize("gen", [dict(draft_k=7), dict(draft_k=3, adaptive_k=True)])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_lookup_greedy_equals_plain(tiny_model, tokenizer, plain_results, name, options, gen):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("prompt-lookup", **options))
    # (on "repeat" the subject is also that it drafts, not whether that pays: the guard would decide by timing noise)
    result = engine.generate(PROMPTS[name], max_new_tokens=MAX_NEW, speculation_guard=name != "repeat", **gen)
    assert result.token_ids == plain_results[name].token_ids
    assert result.finish_reason == plain_results[name].finish_reason
    if name == "repeat":
        assert result.acceptance.drafted_tokens > 0
        assert result.acceptance.accepted_tokens > 0


def _reference(name, plain_results):
    return PROMPTS[name] + plain_results[name].token_ids


CORRUPTIONS = {
    "none": (),
    "first": (0,),
    "second": (1,),
    "third": (2,),
    "last-of-4": (3,),
    "first-and-third": (0, 2),
    "all": range(64),
}


@pytest.mark.parametrize("draft_k", [1, 4, 9])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("name", ["random", "repeat"])
def test_oracle_with_corruptions_equals_plain_with_known_accept_pattern(
    tiny_model, tokenizer, plain_results, oracle_drafter, name, corruption, draft_k
):
    positions = CORRUPTIONS[corruption]
    drafter = oracle_drafter(_reference(name, plain_results), corrupt=positions)
    engine = Engine(tiny_model, tokenizer, drafter=drafter)
    # (the accept pattern is the subject; the guard would stop drafts that never pay: tests/engine/test_guard.py)
    steps, result = collect(
        engine.stream(PROMPTS[name], max_new_tokens=MAX_NEW, draft_k=draft_k, speculation_guard=False)
    )

    assert result.token_ids == plain_results[name].token_ids
    assert result.finish_reason == plain_results[name].finish_reason
    first_bad = min(positions, default=None)
    assert steps[0].num_drafted == 0  # the prefill's token
    produced = len(steps[0].token_ids)
    for step in steps[1:]:
        # the full k, unless the draft plus its bonus would pass max_new_tokens
        assert step.num_drafted == min(draft_k, MAX_NEW - produced - 1)
        expected_accepted = step.num_drafted if first_bad is None else min(first_bad, step.num_drafted)
        assert step.num_accepted == expected_accepted
        produced += len(step.token_ids)
    stats = result.acceptance
    assert stats.accepted_tokens == sum(s.num_accepted for s in steps)
    if first_bad is None:
        assert stats.alpha == 1.0
    elif first_bad == 0:
        assert stats.accepted_tokens == 0 and stats.tau == 1.0
    # the drafter was told exactly what was appended
    assert [(toks, n) for toks, n in drafter.observed] == [(step.token_ids, step.num_accepted) for step in steps[1:]]


def test_oracle_random_corruptions_equal_plain(tiny_model, tokenizer, plain_results, oracle_drafter):
    gen = torch.Generator().manual_seed(7)
    pattern = torch.rand(200, 16, generator=gen) < 0.3  # [step, draft position]
    drafter = oracle_drafter(_reference("repeat", plain_results), corrupt=lambda s, i: bool(pattern[s, i]))
    engine = Engine(tiny_model, tokenizer, drafter=drafter)
    options = dict(max_new_tokens=MAX_NEW, draft_k=6, adaptive_k=True, speculation_guard=False)
    steps, result = collect(engine.stream(PROMPT_REPEAT, **options))
    assert result.token_ids == plain_results["repeat"].token_ids
    for s, step in enumerate(steps[1:]):
        bad = [i for i in range(step.num_drafted) if pattern[s, i]]
        assert step.num_accepted == (bad[0] if bad else step.num_drafted)
    assert 0 < result.acceptance.accepted_tokens < result.acceptance.drafted_tokens


def test_oracle_drafter_is_begun_with_the_prompt(tiny_model, tokenizer, plain_results, oracle_drafter):
    drafter = oracle_drafter(_reference("random", plain_results))
    Engine(tiny_model, tokenizer, drafter=drafter).generate(PROMPT_RANDOM, max_new_tokens=5)
    assert drafter.begun == [PROMPT_RANDOM]


# --- adaptive K ---------------------------------------------------------------


def test_adaptive_k_policy():
    policy = AdaptiveK(3, 6, enabled=True)
    policy.update(3, 3)
    assert policy.k == 5
    policy.update(5, 5)
    assert policy.k == 6  # capped at k_max
    policy.update(6, 2)
    assert policy.k == 5
    policy.update(0, 0)  # an empty draft says nothing
    assert policy.k == 5
    for _ in range(10):
        policy.update(5, 0)
    assert policy.k == 1  # floor
    off = AdaptiveK(3, 6, enabled=False)
    off.update(3, 3)
    off.update(3, 0)
    assert off.k == 3


def test_adaptive_k_grows_on_full_acceptance(tiny_model, tokenizer, plain_results, oracle_drafter):
    drafter = oracle_drafter(_reference("random", plain_results))
    engine = Engine(tiny_model, tokenizer, drafter=drafter)
    engine.generate(PROMPT_RANDOM, max_new_tokens=MAX_NEW, draft_k=2, adaptive_k=True)
    # +2 per fully accepted draft, capped by k_max (default 2 * draft_k = 4)
    assert drafter.requested_k[:3] == [2, 4, 4]
    drafter = oracle_drafter(_reference("random", plain_results))
    engine = Engine(tiny_model, tokenizer, drafter=drafter)
    engine.generate(PROMPT_RANDOM, max_new_tokens=MAX_NEW, draft_k=2, adaptive_k=True, max_draft_k=9)
    assert drafter.requested_k[:5] == [2, 4, 6, 8, 9]


def test_adaptive_k_shrinks_on_rejection(tiny_model, tokenizer, plain_results, oracle_drafter):
    drafter = oracle_drafter(_reference("random", plain_results), corrupt=(0,))
    engine = Engine(tiny_model, tokenizer, drafter=drafter)
    # (no guard: drafts never accepted would be paused after a few steps, which is its subject, not this test's)
    result = engine.generate(PROMPT_RANDOM, max_new_tokens=MAX_NEW, draft_k=5, adaptive_k=True, speculation_guard=False)
    assert drafter.requested_k[:6] == [5, 4, 3, 2, 1, 1]
    assert result.token_ids == plain_results["random"].token_ids


def test_fixed_k_without_adaptive(tiny_model, tokenizer, plain_results, oracle_drafter):
    drafter = oracle_drafter(_reference("random", plain_results), corrupt=(0,))
    Engine(tiny_model, tokenizer, drafter=drafter).generate(
        PROMPT_RANDOM, max_new_tokens=20, draft_k=5, speculation_guard=False
    )
    # one token per step; k is cut only by the tokens left, and no draft is asked for with one left
    assert drafter.requested_k == [min(5, 20 - produced - 1) for produced in range(1, 19)]


# --- sampling -----------------------------------------------------------------


SAMPLING = dict(temperature=1.0, max_new_tokens=32)


@pytest.mark.parametrize("drafter", [None, "ngram", "prompt-lookup"])
def test_sampling_is_reproducible_with_a_seed(tiny_model, tokenizer, drafter):
    def run(seed):
        d = build_drafter(drafter) if drafter else None
        return Engine(tiny_model, tokenizer, drafter=d).generate(PROMPT_REPEAT, seed=seed, **SAMPLING).token_ids

    first = run(1234)
    assert len(first) == 32 or first[-1] == EOS_ID
    assert run(1234) == first
    others = [run(seed) for seed in (1, 2, 3)]
    assert any(o != first for o in others)


def test_sampling_differs_from_greedy(tiny_model, tokenizer, plain_results):
    # At temperature 1 the tiny model is nearly uniform: a sample equal to the greedy path is absurd.
    result = Engine(tiny_model, tokenizer).generate(PROMPT_REPEAT, seed=5, **SAMPLING)
    assert result.token_ids != plain_results["repeat"].token_ids[:32]


@pytest.mark.parametrize("drafter", [None, "ngram", "prompt-lookup", "oracle", "oracle-corrupt"])
def test_top_k_1_sampling_equals_greedy(
    tiny_model, tokenizer, plain_results, drafter, oracle_drafter, linear_pass_costs
):
    # top_k=1 makes p one-hot on the argmax, so the sampling path (and its
    # rejection sampler) must reproduce greedy decoding exactly. (Fixed pass costs: that a
    # draft is accepted must not hang on this machine's timing; [prompt-lookup] failed so.)
    if drafter is None:
        d = None
    elif drafter.startswith("oracle"):
        corrupt = (1,) if drafter.endswith("corrupt") else ()
        d = oracle_drafter(_reference("repeat", plain_results), corrupt=corrupt)
    else:
        d = build_drafter(drafter)
    result = Engine(tiny_model, tokenizer, drafter=d).generate(
        PROMPT_REPEAT, temperature=0.7, top_k=1, seed=3, max_new_tokens=MAX_NEW
    )
    assert result.token_ids == plain_results["repeat"].token_ids
    if d is not None:
        assert result.acceptance.accepted_tokens > 0


def test_sampling_with_top_p_and_top_k_stays_in_the_kept_set(tiny_model, tokenizer):
    # With top_k=2 every emitted token must be one of the target's two best at its position.
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", n=3))
    result = engine.generate(PROMPT_REPEAT, temperature=1.5, top_k=2, top_p=0.95, seed=11, max_new_tokens=40)
    ids = torch.tensor([PROMPT_REPEAT + result.token_ids])
    with torch.no_grad():
        logits = tiny_model(ids).logits[0, len(PROMPT_REPEAT) - 1 : -1]
    top2 = logits.topk(2, dim=-1).indices
    for pos, tok in enumerate(result.token_ids):
        assert tok in top2[pos].tolist()


# --- edge cases ---------------------------------------------------------------


def test_empty_draft_is_plain_decoding_with_tau_one(tiny_model, tokenizer, plain_results, empty_drafter):
    drafter = empty_drafter
    result = Engine(tiny_model, tokenizer, drafter=drafter).generate(PROMPT_RANDOM, max_new_tokens=MAX_NEW)
    assert result.token_ids == plain_results["random"].token_ids
    stats = result.acceptance
    assert stats.drafted_tokens == 0 and stats.accepted_tokens == 0
    assert stats.steps == result.num_new_tokens - 1
    assert drafter.calls == stats.steps - 1  # with one token left there is no room to draft
    assert stats.tau == 1.0
    assert stats.alpha == 0.0
    assert stats.per_position_acceptance == []


@pytest.mark.parametrize("ignore_k", [False, True])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 10])
def test_draft_never_overruns_max_new_tokens(
    tiny_model, tokenizer, plain_results, oracle_drafter, max_new_tokens, ignore_k
):
    drafter = oracle_drafter(_reference("random", plain_results), ignore_k=ignore_k)
    engine = Engine(tiny_model, tokenizer, drafter=drafter)
    steps, result = collect(engine.stream(PROMPT_RANDOM, max_new_tokens=max_new_tokens, draft_k=16))
    assert result.num_new_tokens == max_new_tokens == len(result.token_ids)
    assert result.token_ids == plain_results["random"].token_ids[:max_new_tokens]
    assert result.finish_reason == "length"
    # the loop never asks for more than fits: k <= tokens left - 1 (room for the bonus)
    produced = 1
    for k, step in zip(drafter.requested_k, steps[1:]):
        assert k == min(16, max_new_tokens - produced - 1)
        assert step.num_drafted <= k
        produced += len(step.token_ids)
    # a full-length finish never stops mid-draft, so steps account for every token but the first
    assert result.acceptance.step_tokens == result.num_new_tokens - 1


def test_max_new_tokens_one_does_not_draft(tiny_model, tokenizer, empty_drafter):
    drafter = empty_drafter
    result = Engine(tiny_model, tokenizer, drafter=drafter).generate(PROMPT_RANDOM, max_new_tokens=1)
    assert result.num_new_tokens == 1 and drafter.calls == 0
    assert result.acceptance.steps == 0
    assert result.decode_tokens_per_s == 0.0


def _eos_case(plain_results):
    """A token the plain greedy output reaches mid-way, first at index >= 5."""
    out = plain_results["random"].token_ids
    for pos in range(5, len(out)):
        if out[pos] not in out[:pos] and out[pos] > 2:
            return out[pos], pos
    raise AssertionError("no fresh token in the reference output")


@pytest.mark.parametrize("draft_k", [1, 3, 4, 8, 16])
def test_eos_inside_accepted_draft_stops_exactly(eos_variant, oracle_drafter, plain_results, draft_k):
    eos, pos = _eos_case(plain_results)
    model, tok = eos_variant(eos)
    expected = plain_results["random"].token_ids[: pos + 1]

    plain = Engine(model, tok).generate(PROMPT_RANDOM, max_new_tokens=MAX_NEW)
    assert plain.token_ids == expected
    assert plain.finish_reason == "eos"
    assert hf_greedy(model, PROMPT_RANDOM, MAX_NEW, eos) == expected

    # the oracle keeps drafting past EOS (from the original reference)
    drafter = oracle_drafter(_reference("random", plain_results))
    engine = Engine(model, tok, drafter=drafter)
    steps, spec = collect(engine.stream(PROMPT_RANDOM, max_new_tokens=MAX_NEW, draft_k=draft_k))
    assert spec.token_ids == expected
    assert spec.finish_reason == "eos"
    assert spec.text == plain.text == tok.decode(expected[:-1])
    last = steps[-1]
    assert last.token_ids[-1] == eos
    # Every draft is accepted, so step j covers output indices (j-1)(k+1)+1 .. j(k+1)
    # and the bonus tokens sit at multiples of k + 1.
    if pos % (draft_k + 1):
        # EOS was an accepted draft token with more accepted ones after it: cut mid-draft
        assert len(last.token_ids) <= last.num_accepted
        assert spec.acceptance.step_tokens >= spec.num_new_tokens - 1
    else:
        assert len(last.token_ids) == last.num_accepted + 1
        assert spec.acceptance.step_tokens == spec.num_new_tokens - 1


@pytest.mark.parametrize("drafter", ["ngram", "prompt-lookup"])
def test_eos_with_ngram_drafters(tiny_model, tokenizer, plain_results, drafter):
    # The one-token prompt's greedy output ends in the real EOS id.
    expected = plain_results["one-token"]
    assert expected.finish_reason == "eos"
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter(drafter))
    result = engine.generate(PROMPT_ONE, max_new_tokens=MAX_NEW)
    assert result.token_ids == expected.token_ids
    assert result.finish_reason == "eos"


def _stop_string(plain_results, name="random"):
    text = plain_results[name].text
    stop = text[10:13]  # three characters = three tokens
    return stop, text.find(stop)


@pytest.mark.parametrize("draft_k", [2, 5, 12])
def test_stop_string_across_draft_tokens(tiny_model, tokenizer, plain_results, draft_k, oracle_drafter):
    stop, at = _stop_string(plain_results)
    full = plain_results["random"]
    plain = Engine(tiny_model, tokenizer).generate(PROMPT_RANDOM, max_new_tokens=MAX_NEW, stop=[stop])
    assert plain.finish_reason == "stop"
    assert plain.text == full.text[:at]
    assert stop not in plain.text
    assert plain.token_ids == full.token_ids[: at + len(stop)]  # up to the token completing the stop

    drafter = oracle_drafter(_reference("random", plain_results))
    steps, spec = collect(
        Engine(tiny_model, tokenizer, drafter=drafter).stream(
            PROMPT_RANDOM, max_new_tokens=MAX_NEW, stop=(stop, "never-there"), draft_k=draft_k
        )
    )
    assert spec.finish_reason == "stop"
    assert spec.text == plain.text
    assert spec.token_ids == plain.token_ids
    assert "".join(s.text for s in steps) == spec.text
    if draft_k == 12:
        # the first step covers output indices 1..13 and the stop ends by index 12:
        # it was completed by an accepted draft token, mid-draft
        assert at + len(stop) - 1 <= 12
        assert len(steps) == 2
        assert steps[-1].num_accepted > len(steps[-1].token_ids) - 1


def test_stop_as_a_single_string_and_text_holdback(tiny_model, tokenizer, plain_results):
    stop, at = _stop_string(plain_results)
    engine = Engine(tiny_model, tokenizer)
    steps, result = collect(engine.stream(PROMPT_RANDOM, max_new_tokens=MAX_NEW, stop=stop))
    assert result.text == plain_results["random"].text[:at]
    # Text that may grow into the stop string is held back: nothing streamed is ever taken back.
    released = ""
    for step in steps:
        released += step.text
        assert result.text.startswith(released)
    assert released == result.text


@pytest.mark.parametrize("drafter", [None, "ngram", "oracle"])
def test_context_limit(tiny_model, tokenizer, drafter, oracle_drafter):
    prompt = (PROMPT_REPEAT * 6)[: CONTEXT_LENGTH - 9]  # room for 9 new tokens
    plain = Engine(tiny_model, tokenizer).generate(prompt, max_new_tokens=50)
    assert plain.finish_reason == "context"
    assert plain.num_prompt_tokens + plain.num_new_tokens == CONTEXT_LENGTH
    d = oracle_drafter(prompt + plain.token_ids) if drafter == "oracle" else build_drafter(drafter) if drafter else None
    result = Engine(tiny_model, tokenizer, drafter=d).generate(prompt, max_new_tokens=50, draft_k=16)
    assert result.finish_reason == "context"
    assert len(prompt) + result.num_new_tokens == CONTEXT_LENGTH
    assert result.token_ids == plain.token_ids
    if drafter == "oracle":
        assert d.requested_k[0] == 7  # 8 tokens left after the first: k + bonus fits
        assert max(d.requested_k) <= 7


def test_prompt_one_short_of_context_gives_one_token(tiny_model, tokenizer):
    prompt = (PROMPT_REPEAT * 6)[: CONTEXT_LENGTH - 1]
    result = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram")).generate(prompt, max_new_tokens=10)
    assert result.num_new_tokens == 1
    assert result.finish_reason == "context"


@pytest.mark.parametrize("excess", [0, 5])
def test_prompt_too_long(tiny_model, tokenizer, excess):
    prompt = (PROMPT_REPEAT * 8)[: CONTEXT_LENGTH + excess]
    with pytest.raises(PromptTooLongError):
        Engine(tiny_model, tokenizer).generate(prompt)
    with pytest.raises(PromptTooLongError):
        Engine(tiny_model, tokenizer, drafter=build_drafter("ngram")).stream(prompt)


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt_is_config_error(tiny_model, tokenizer, prompt):
    with pytest.raises(ConfigError):
        Engine(tiny_model, tokenizer).generate(prompt)


def test_unknown_option_is_config_error(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer)
    with pytest.raises(ConfigError, match="temprature"):
        engine.generate(PROMPT_RANDOM, temprature=0.5)
    with pytest.raises(ConfigError):
        engine.stream(PROMPT_RANDOM, max_tokens=5)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_new_tokens=0),
        dict(max_new_tokens=True),
        dict(max_new_tokens=2.5),
        dict(draft_k=0),
        dict(draft_k=True),
        dict(draft_k=4, max_draft_k=3),
        dict(stop=("",)),
        dict(stop=(3,)),
        dict(temperature=-1.0),
        dict(top_p=0.0),
    ],
)
def test_bad_generation_options_are_config_errors(tiny_model, tokenizer, options):
    with pytest.raises(ConfigError):
        Engine(tiny_model, tokenizer).generate(PROMPT_RANDOM, **options)


def test_generation_config_from_options_keeps_base_and_overrides():
    base = GenerationConfig(max_new_tokens=9, draft_k=3, sampling=SamplingParams(temperature=0.5, seed=1))
    cfg = GenerationConfig.from_options(base, top_k=4, draft_k=5)
    assert cfg.max_new_tokens == 9 and cfg.draft_k == 5
    assert cfg.sampling == SamplingParams(temperature=0.5, top_k=4, seed=1)
    assert GenerationConfig(stop="x").stop == ("x",)


def test_engine_config_is_the_default_for_requests(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, config=GenerationConfig(max_new_tokens=4))
    assert engine.generate(PROMPT_RANDOM).num_new_tokens == 4
    assert engine.generate(PROMPT_RANDOM, max_new_tokens=6).num_new_tokens == 6
    explicit = GenerationConfig(max_new_tokens=3)
    assert engine.generate(PROMPT_RANDOM, config=explicit).num_new_tokens == 3


def test_chat_without_template_is_config_error(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer)
    with pytest.raises(ConfigError):
        engine.encode("hello", chat=True)
    with pytest.raises(ConfigError):
        engine.generate("hello", chat=True)
    # no template: the default is raw text
    assert engine.encode("hi") == tokenizer("hi")["input_ids"]
    assert engine.encode([5, 6]) == [5, 6]
    assert engine.encode(torch.tensor([5, 6])) == [5, 6]


# --- streaming and statistics -------------------------------------------------


STREAM_CASES = {
    "plain": lambda ref, oracle: None,
    "ngram": lambda ref, oracle: build_drafter("ngram", n=3),
    "prompt-lookup": lambda ref, oracle: build_drafter("prompt-lookup"),
    "oracle": lambda ref, oracle: oracle(ref, corrupt=(2,)),
}


@pytest.mark.parametrize("stop", [None, "stop"])
@pytest.mark.parametrize("case", list(STREAM_CASES))
@pytest.mark.parametrize("name", ["random", "repeat"])
def test_stream_concatenates_to_result(tiny_model, tokenizer, plain_results, name, case, stop, oracle_drafter):
    options = dict(max_new_tokens=MAX_NEW, draft_k=5)
    if stop:
        options["stop"] = _stop_string(plain_results, name)[0]
    drafter = STREAM_CASES[case](_reference(name, plain_results), oracle_drafter)
    stream = Engine(tiny_model, tokenizer, drafter=drafter).stream(PROMPTS[name], **options)
    assert stream.result is None  # set only once iteration ends
    steps, result = collect(stream)
    assert result is not None
    assert [t for s in steps for t in s.token_ids] == result.token_ids
    assert "".join(s.text for s in steps) == result.text
    assert all(s.token_ids for s in steps)  # every step appends at least one token
    assert result.finish_reason == ("stop" if stop else plain_results[name].finish_reason)

    if drafter is None:
        assert result.acceptance is None
        assert all(s.num_drafted == 0 and len(s.token_ids) == 1 for s in steps)
        return
    stats = result.acceptance
    assert stats.steps == len(steps) - 1
    assert stats.drafted_tokens == sum(s.num_drafted for s in steps)
    assert stats.accepted_tokens == sum(s.num_accepted for s in steps)
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert all(0 <= s.num_accepted <= s.num_drafted for s in steps)
    assert all(len(s.token_ids) <= s.num_accepted + 1 for s in steps)
    if result.finish_reason == "length":
        assert stats.step_tokens == result.num_new_tokens - 1
        assert all(len(s.token_ids) == s.num_accepted + 1 for s in steps[1:])
    else:  # may stop mid-draft: steps counted tokens that were cut
        assert stats.step_tokens >= result.num_new_tokens - 1
    assert stats.tau == pytest.approx(stats.step_tokens / stats.steps)
    assert stats.draft_k == 5


def test_result_fields(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"))
    result = engine.generate(PROMPT_REPEAT, max_new_tokens=20)
    assert result.ttft_s >= 0 and result.wall_s >= result.ttft_s
    assert result.decode_tokens_per_s > 0
    d = result.to_dict()
    assert d["token_ids"] == result.token_ids and d["drafter"] == "ngram"
    assert d["acceptance"]["steps"] == result.acceptance.steps


def test_engine_reusable_across_requests(tiny_model, tokenizer, plain_results):
    # The cache and the drafter state are reset between requests.
    engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"))
    for name in ("repeat", "random", "repeat", "one-token"):
        assert engine.generate(PROMPTS[name], max_new_tokens=MAX_NEW).token_ids == plain_results[name].token_ids


# --- the sampled distribution, end to end --------------------------------------


class ConstantDrafter(Drafter):
    """Always drafts the same token(s): a deterministic drafter (q = None)."""

    name = "constant-test"

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, context, k):
        return Draft(self.tokens[:k])


def test_speculative_sampling_matches_the_target_distribution(tiny_model, tokenizer):
    """The first three sampled tokens follow the target's own distribution.

    A constant drafter proposes token 5 every step (accepted about half the
    time), so the loop exercises acceptance, the bonus token, recovery and the
    cache rollback. The exact marginals of tokens 2 and 3 are computed by
    enumerating the (few) prefixes top_k leaves possible; chi-square at
    alpha = 0.001 with fixed seeds. The requests run 100 at a time, each drafting
    K = 2 as it would alone (DraftToTheCaps): each sample is the one a call of its
    own gives (a row's bits do not depend on its batch; its generator is seeded).
    """
    params = SamplingParams(temperature=0.01, top_k=8)
    prompt = PROMPT_REPEAT
    with torch.no_grad():
        p1 = probabilities(tiny_model(torch.tensor([prompt])).logits[0, -1:], params)[0]  # [V]
        firsts = p1.nonzero()[:, 0].tolist()
        p2 = probabilities(tiny_model(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1], params)
        pairs = [(a, b) for i, a in enumerate(firsts) for b in p2[i].nonzero()[:, 0].tolist()]
        p3 = probabilities(tiny_model(torch.tensor([prompt + [a, b] for a, b in pairs])).logits[:, -1], params)
    marginal2 = p1[firsts] @ p2  # [V]
    weights = torch.tensor([float(p1[a] * p2[firsts.index(a), b]) for a, b in pairs])
    marginal3 = weights @ p3  # [V]
    assert float(marginal2[5]) > 0.3  # the constant draft is often right

    engine = Engine(tiny_model, tokenizer, drafter=ConstantDrafter([5, 5]), max_num_seqs=100)
    engine.policy = DraftToTheCaps()  # K = 2 in a batch too, as alone: the samples of one call per seed
    runs = 2000
    results = generate_per_seed(
        engine, prompt, GenerationConfig(max_new_tokens=3, draft_k=2, sampling=params), range(runs)
    )
    outputs = [r.token_ids for r in results]
    accepted = sum(r.acceptance.accepted_tokens for r in results)
    assert all(len(out) == 3 for out in outputs)
    assert accepted > runs * 0.3
    assert binned_chisquare_pvalue([o[0] for o in outputs], p1) > 0.001
    assert binned_chisquare_pvalue([o[1] for o in outputs], marginal2) > 0.001
    assert binned_chisquare_pvalue([o[2] for o in outputs], marginal3) > 0.001
    # negative control: the same test rejects the draft's own (wrong) distribution for token 2
    wrong = marginal2.clone()
    wrong[5] += 0.15
    assert binned_chisquare_pvalue([o[1] for o in outputs], wrong) < 0.001
