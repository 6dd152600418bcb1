"""One rule for prompts in every front end: bytes are a TypeError (not token ids), an empty
prompt is refused before a chat template or a BOS token could make it look non-empty, and
text must be valid UTF-8 (a lone surrogate is bad input, not a tokenizer crash).
The server's side of the same rule is in tests/server/test_hardening.py; the CLI's in
tests/test_bad_inputs.py ("the prompt is empty")."""

from __future__ import annotations

import pytest

from fastdecode.decoding.tokenization import EmptyPromptError, PromptTypeError, encode_messages, encode_prompt
from fastdecode.engine import Engine
from fastdecode.errors import ConfigError


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return Engine(tiny_model, tokenizer, max_num_seqs=2)


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    """The character tokenizer with a chat template: "role: content | assistant: "."""

    class ChatCharTokenizer(type(tokenizer)):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return " | ".join(f"{m['role']}: {m['content']}" for m in messages) + " | assistant: "

    chat = ChatCharTokenizer()
    chat.chat_template = "role: content | ..."  # rendered by apply_chat_template above
    return chat


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"hello"), memoryview(b"hello")])
def test_bytes_are_a_type_error_not_token_ids(engine, prompt):
    with pytest.raises(TypeError, match=r"decode it first"):
        engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(PromptTypeError):  # also a ConfigError: the CLI and the server report it as bad input
        engine.add_request(prompt, max_new_tokens=2)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompt", ["", []])
@pytest.mark.parametrize("chat", [None, False])
def test_an_empty_prompt_is_refused(engine, prompt, chat):
    with pytest.raises(EmptyPromptError, match="the prompt is empty"):
        engine.generate(prompt, max_new_tokens=2, chat=chat)
    assert not engine.has_unfinished()


def test_an_empty_prompt_is_refused_even_where_a_template_or_bos_would_fill_it(chat_tokenizer, tokenizer):
    # The character tokenizer prepends BOS to non-empty text and a chat template renders "user:  | assistant: ".
    with pytest.raises(EmptyPromptError):
        encode_prompt(chat_tokenizer, "", 100, chat=True)
    with pytest.raises(EmptyPromptError, match="every message's content is empty"):
        encode_messages(chat_tokenizer, [{"role": "system", "content": ""}, {"role": "user", "content": ""}])
    # One message with content is a prompt.
    assert encode_messages(chat_tokenizer, [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}])
    assert encode_prompt(tokenizer, " ", 100, chat=False)  # whitespace is text


def test_a_lone_surrogate_is_bad_input_in_text_and_in_chat(chat_tokenizer, smollm2_tokenizer):
    for tok in (chat_tokenizer, smollm2_tokenizer):
        with pytest.raises(ConfigError, match=r"messages\[1\]\.content is not valid UTF-8"):
            encode_messages(tok, [{"role": "user", "content": "hi"}, {"role": "user", "content": "a\ud800b"}])
        with pytest.raises(ConfigError, match="not valid UTF-8"):
            encode_prompt(tok, "x\udfff", 10**6, chat=False)
