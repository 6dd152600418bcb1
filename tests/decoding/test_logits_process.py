"""Logits processors (penalties, bias, min_tokens, a grammar) applied by verification per row:
speculative output token-identical to plain decoding under every drafter (greedy), the same
distribution (sampling, with a negative control), and the processors' arithmetic by hand."""

from __future__ import annotations

import json

import pytest
import torch
from stats_helpers import binned_chisquare_pvalue
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.decoding.logits_process import LogitsProcessor, ProcessingParams
from fastdecode.decoding.sampling import SamplingParams, probabilities
from fastdecode.decoding.structured import GrammarSpec
from fastdecode.errors import ConfigError

VOCAB = 128  # the character tokenizer then has "{", "|", "}" and "~": JSON can close
PAD_ID, BOS_ID, EOS_ID, CONTEXT_LENGTH = 0, 1, 2, 128  # the tests' tiny models (tests/conftest.py)
PROMPT = [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22]
DRAFTERS = ["ngram", "prompt-lookup", "suffix", "recycling", "draft-model", "layer-skip", "hybrid"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["s", "m", "xl"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["ok", "size", "n"],
    "additionalProperties": False,
}
SETTINGS = {
    "penalties": dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.4),
    "bias and min_tokens": dict(logit_bias={EOS_ID: 5.0, 40: 4.0, 41: -100}, min_tokens=6),
    "json schema": dict(grammar=GrammarSpec.json_schema(SCHEMA), frequency_penalty=0.3),
    "regex": dict(grammar=GrammarSpec("regex", "[a-f]{2,6}( [0-9]+)?")),
}


def _model(seed: int = 0):
    return tiny_llama(
        seed,
        vocab_size=VOCAB,
        max_position_embeddings=CONTEXT_LENGTH,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        pad_token_id=PAD_ID,
    )


@pytest.fixture(scope="module")
def target():
    return _model(0)


@pytest.fixture(scope="module")
def tok(tokenizer):
    return type(tokenizer)(vocab_size=VOCAB)  # the tests' character tokenizer, over 128 ids


def _drafter(name: str, target):
    if name in ("draft-model", "hybrid"):
        return build_drafter(name, model=_model(7), k=3)
    if name == "layer-skip":
        return build_drafter(name, model=target, k=3)
    return build_drafter(name, k=3)


@pytest.fixture(scope="module")
def plain(target, tok):
    engine = Engine(target, tok)
    return {key: engine.generate(PROMPT, max_new_tokens=40, **options) for key, options in SETTINGS.items()}


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_speculative_equals_plain_under_every_processor(target, tok, plain, name):
    engine = Engine(target, tok, drafter=_drafter(name, target), max_num_seqs=4)
    results = engine.generate([PROMPT] * len(SETTINGS), max_new_tokens=40)  # warm the drafter's state
    for key, options in SETTINGS.items():
        result = engine.generate(PROMPT, max_new_tokens=40, **options)
        assert result.token_ids == plain[key].token_ids, key
    assert results  # (batched requests too, below)


def test_settings_change_the_output_and_hold(target, tok, plain):
    base = Engine(target, tok).generate(PROMPT, max_new_tokens=40)
    for key in SETTINGS:
        assert plain[key].token_ids != base.token_ids, key
    biased = plain["bias and min_tokens"].token_ids
    assert len(biased) == 7 and biased[-1] == EOS_ID  # EOS biased up, forbidden until 6 tokens are out
    assert 41 not in biased
    json.loads(plain["json schema"].text)
    import re

    assert re.fullmatch("[a-f]{2,6}( [0-9]+)?", plain["regex"].text)


def test_batched_trees_and_logprobs_under_processors(target, tok, plain):
    """Four requests at once, two alternative paths a step, logprobs from the processed rows."""
    engine = Engine(target, tok, drafter=build_drafter("ngram", n=2, k=4), max_num_seqs=4)
    ids = {
        key: engine.add_request(PROMPT, max_new_tokens=40, draft_tree=2, logprobs=1, **o) for key, o in SETTINGS.items()
    }
    tokens = {i: [] for i in ids.values()}
    logprobs = {i: [] for i in ids.values()}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            logprobs[out.request_id] += out.logprobs
    one = Engine(target, tok)
    for key, request_id in ids.items():
        assert tokens[request_id] == plain[key].token_ids, key
        alone = one.generate(PROMPT, max_new_tokens=40, logprobs=1, **SETTINGS[key]).logprobs
        assert [e.logprob for e in logprobs[request_id]] == pytest.approx([e.logprob for e in alone], abs=1e-5)


def test_json_schema_output_always_validates(target, tok):
    jsonschema = pytest.importorskip("jsonschema")
    grammar = GrammarSpec.json_schema(SCHEMA)
    engine = Engine(target, tok, drafter=build_drafter("draft-model", model=_model(7), k=4), max_num_seqs=8)
    for speculate in (False, True):
        results = engine.generate(
            [PROMPT[: 4 + i] for i in range(8)],
            max_new_tokens=60,
            temperature=1.0,
            grammar=grammar,
            speculate=speculate,
        )
        for r in results:
            assert r.finish_reason == "eos"
            jsonschema.validate(json.loads(r.text), SCHEMA)
    obj = engine.generate(PROMPT, max_new_tokens=60, grammar=GrammarSpec.json_object(), seed=1, temperature=1.0)
    assert obj.text.startswith("{")  # any object (free keys: the random model may not close it in 60 tokens)
    if obj.finish_reason == "eos":
        assert isinstance(json.loads(obj.text), dict)


def test_a_dict_grammar_is_a_json_schema(target, tok, plain):
    result = Engine(target, tok).generate(PROMPT, max_new_tokens=40, grammar=SCHEMA, frequency_penalty=0.3)
    assert result.token_ids == plain["json schema"].token_ids


def _by_hand(logits: torch.Tensor, prompt: list[int], generated: list[int], rep: float, freq: float, pres: float):
    """The penalties as OpenAI and transformers define them, one row."""
    row = logits.clone().float()
    for t in set(prompt) | set(generated):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(generated):
        row[t] -= freq * generated.count(t) + pres
    return row


def test_each_row_sees_its_own_history():
    params = ProcessingParams(frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.3, min_tokens=3)
    processor = LogitsProcessor(params, [5, 6], [EOS_ID], 16)
    logits = torch.randn(3, 16)
    out = processor.process(logits, [7, 7], [8, 7])
    assert torch.equal(out[0][:EOS_ID], _by_hand(logits[0], [5, 6], [7, 7], 1.3, 0.7, 0.2)[:EOS_ID])
    assert torch.isneginf(out[0, EOS_ID])  # 2 tokens < min_tokens
    assert torch.allclose(out[1], _by_hand(logits[1], [5, 6], [7, 7, 8], 1.3, 0.7, 0.2))
    assert torch.allclose(out[2], _by_hand(logits[2], [5, 6], [7, 7, 8, 7], 1.3, 0.7, 0.2))
    assert torch.equal(logits, logits.clone())  # the input rows are left alone


def test_sampling_with_penalties_keeps_the_distribution(target, tok):
    """Rejection sampling against the draft model's own q, under penalties: the second token
    follows the penalised marginal (and not the unpenalised one: the negative control)."""
    params = SamplingParams(temperature=1.0, top_k=6)
    rep, freq, pres = 1.6, 2.0, 0.5
    prompt = [1] + [20, 21, 22, 23] * 3
    with torch.no_grad():
        raw1 = target(torch.tensor([prompt])).logits[0, -1]
        p1 = probabilities(_by_hand(raw1, prompt, [], rep, freq, pres)[None], params)[0]
        firsts = p1.nonzero()[:, 0].tolist()
        raw2 = target(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1]
    p2 = torch.stack(
        [probabilities(_by_hand(raw2[i], prompt, [a], rep, freq, pres)[None], params)[0] for i, a in enumerate(firsts)]
    )
    marginal = p1[firsts] @ p2  # [V]
    q1 = probabilities(raw1[None], params)[0]
    unpenalised = q1[q1.nonzero()[:, 0]] @ probabilities(
        target(torch.tensor([prompt + [a] for a in q1.nonzero()[:, 0].tolist()])).logits[:, -1].detach(), params
    )
    engine = Engine(target, tok, drafter=build_drafter("draft-model", model=_model(7), k=2), max_num_seqs=8)
    runs = 500
    options = dict(
        max_new_tokens=3,
        temperature=1.0,
        top_k=6,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
    )
    ids = [engine.add_request(prompt, seed=s, **options) for s in range(runs)]
    seconds = {i: [] for i in ids}
    drafted = 0
    while engine.has_unfinished():
        for out in engine.step():
            seconds[out.request_id] += out.token_ids
            drafted += out.num_drafted
    assert drafted >= runs  # each second token was drafted and verified (accepted or recovered)
    results = [seconds[i][1] for i in ids]
    assert binned_chisquare_pvalue(results, marginal) > 0.001
    assert binned_chisquare_pvalue(results, unpenalised) < 0.001


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(logit_bias={VOCAB + 5: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={"x": 1.0}), "token ids"),
        (dict(logit_bias={5: 101}), r"logit_bias\[5\]"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(grammar="json"), "GrammarSpec"),
    ],
)
def test_bad_settings_are_one_clear_error(target, tok, options, match):
    with pytest.raises(ConfigError, match=match):
        Engine(target, tok).add_request(PROMPT, **options)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
            "cannot be compiled",
        ),
        (lambda: GrammarSpec.json_schema("[1, 2]"), "JSON object"),
        (lambda: GrammarSpec("regex", "[0-9"), "cannot be compiled"),
        (lambda: GrammarSpec("yaml", "x"), "kind"),
    ],
)
def test_bad_grammars_are_one_clear_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
