"""Prompts to token ids: the one path the engine, the server and the benchmarks share.

A prompt is text, token ids, or (the chat API) a list of messages; text becomes one
user message when the tokenizer has a chat template and ``chat`` is not False.

One rule for every front end (``engine.generate``, ``generate``, ``/v1/completions``,
``/v1/chat/completions``): text must be valid UTF-8 (no lone surrogates), and an empty
prompt (``""``, no token ids, or messages whose contents are all empty) is refused with
:class:`EmptyPromptError`, before any template or special token could make it look non-empty.
Bytes are refused with :class:`PromptTypeError` rather than read as token ids.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from fastdecode.errors import ConfigError

EMPTY_PROMPT = "the prompt is empty"


class EmptyPromptError(ConfigError):
    """An empty prompt: nothing to condition on (one message, whichever front end refused it)."""


class PromptTypeError(ConfigError, TypeError):
    """A prompt that is neither text nor token ids (bytes, a number, ...): a TypeError, and a
    ConfigError so the CLI and the server report it like any other bad input."""


def check_text(text: str, what: str = "the prompt") -> None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate such as JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{what} is not valid UTF-8 text (character {exc.start}: {text[exc.start]!r})") from None


def check_token_ids(prompt, vocab_size: int) -> list[int]:
    """``prompt`` (a sequence or a tensor of ints) as a list of ids within the vocabulary."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise PromptTypeError(
            f"the prompt is {type(prompt).__name__}, not text or token ids: decode it first (prompt.decode('utf-8'))"
        )
    if not isinstance(prompt, Sequence) and not isinstance(prompt, torch.Tensor):
        raise PromptTypeError(f"the prompt must be text or a sequence of token ids, got {type(prompt).__name__}")
    values = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in values):
        raise ConfigError("token ids must be integers")
    ids = [int(t) for t in values]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation through the model's chat template, ready for the assistant's turn."""
    if not has_chat_template(tokenizer):
        raise ConfigError("this model has no chat template: use /v1/completions with raw text")
    contents = [message.get("content") for message in messages]
    for i, content in enumerate(contents):
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
    if all(content == "" for content in contents):
        raise EmptyPromptError(f"{EMPTY_PROMPT}: every message's content is empty")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own checks (alternating roles, ...) raise
        raise ConfigError(f"the model's chat template refused these messages: {exc}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer, prompt: str | Sequence[int], vocab_size: int, chat: bool | None = None) -> list[int]:
    """Token ids for ``prompt``; with ``chat`` (default: when the tokenizer has a chat
    template) text becomes one user message."""
    if not isinstance(prompt, str):
        ids = check_token_ids(prompt, vocab_size)
    else:
        check_text(prompt)
        if prompt == "":
            raise EmptyPromptError(EMPTY_PROMPT)
        if chat and not has_chat_template(tokenizer):
            raise ConfigError("this model has no chat template; send raw text (--no-chat)")
        if chat is None:
            chat = has_chat_template(tokenizer)
        if chat:
            ids = encode_messages(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise EmptyPromptError(EMPTY_PROMPT)
    return ids
