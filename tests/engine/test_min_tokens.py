"""min_tokens as vLLM defines it: the end-of-sequence ids are masked, and no stop string ends
in the first min_tokens tokens' text (one may begin there and end later); speculative output
stays token-identical to plain decoding's."""

from __future__ import annotations

import pytest

from fastdecode import Engine, build_drafter
from fastdecode.decoding.detokenize import IncrementalDetokenizer

PROMPT = [1, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21]


def test_stop_strings_wait_for_min_tokens(tiny_model, tokenizer):
    free = Engine(tiny_model, tokenizer).generate(PROMPT, max_new_tokens=24, speculate=False)
    text = free.text
    stop = text[1]  # a character the greedy text holds early on
    assert len(text) == len(free.token_ids)  # the test tokenizer: one character a token
    for min_tokens in (0, 3, 8):
        expected_end = text.find(stop, min_tokens)  # the first occurrence in a token after the first min_tokens
        options = dict(max_new_tokens=24, stop=[stop], min_tokens=min_tokens, logit_bias={2: -100.0})
        plain = Engine(tiny_model, tokenizer).generate(PROMPT, speculate=False, **options)
        spec = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram", k=3)).generate(PROMPT, **options)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        if expected_end < 0:
            assert plain.finish_reason == "length"
        else:
            assert plain.finish_reason == "stop" and plain.text == text[:expected_end]


@pytest.mark.parametrize(
    "min_tokens, stop, expected",
    [(0, "b", "a"), (2, "b", "abca"), (4, "cab", "ab"), (5, "cab", "abcab")],
)
def test_a_stop_string_may_begin_in_the_first_min_tokens(tokenizer, min_tokens, stop, expected):
    """Tokens a, b, c, a, b, c, ... one character each: a stop string must end after the
    min_tokens-th token's text (vLLM: tests/detokenizer/test_min_tokens.py)."""
    detok = IncrementalDetokenizer(tokenizer, (), (stop,), min_tokens=min_tokens)
    ids = tokenizer("abcabcabc", add_special_tokens=False)["input_ids"]
    for t in ids:
        if detok.add([t]):
            break
    assert detok.text == expected
