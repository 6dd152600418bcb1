"""Structured output: a grammar (JSON object, JSON schema, regex, Lark) that the tokens must match.

Built on llguidance (Microsoft's guidance engine: MIT licence, a Rust core with CPU wheels,
no torch or triton dependency; its token masks take tens of microseconds on CPU, and its
matcher can roll back, which speculation needs). xgrammar pulls triton, and outlines pulls
far more; both are heavier to install on a CPU machine for the same job.

A ``GrammarSpec`` is what a request asks for (text, checked when it is made); a
``GrammarMatcher`` is one request's parser state over it. For each row of a verification
pass the matcher gives the mask after the context plus the draft tokens before that row
(``masks``), then rolls back; after the step it consumes the tokens taken (``advance``).
A draft is cut at its first token the grammar forbids (``valid_prefix``) before the pass.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastdecode.errors import ConfigError

KINDS = ("json_object", "json_schema", "regex", "lark")
# JSON as json.dumps writes it (", " and ": ", no other whitespace): free whitespace would let a
# model pad forever inside a valid document; a schema's "x-guidance" options can still say otherwise.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ConfigError("structured output needs llguidance: pip install 'fastdecode[structured]'") from None
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    """``kind``: one of KINDS; ``source``: the JSON schema (JSON text), the regex or the Lark grammar."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ConfigError("a grammar's source must be text")
        error = _llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ConfigError(f"the {self.kind.replace('_', ' ')} cannot be compiled: {error.strip()[:300]}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        try:
            parsed = json.loads(schema)
        except (TypeError, ValueError):
            raise ConfigError("a JSON schema must be a JSON object") from None
        if not isinstance(parsed, dict):
            raise ConfigError("a JSON schema must be a JSON object")
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    def grammar(self) -> str:
        """llguidance's grammar text."""
        matcher = _llguidance().LLMatcher
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                return matcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            except ValueError as exc:
                raise ConfigError(f"the JSON schema cannot be compiled: {exc}") from None
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        return matcher.grammar_from_lark(self.source)


class _TokenTable:
    """A tokenizer that is not a Hugging Face fast one, as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(vocab_size)]
        self.special_token_ids = [i for i in (self.eos_token_id, self.bos_token_id) if i is not None]

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's view of ``tokenizer`` (about a second to build for a real vocabulary: build it once)."""
    llg = _llguidance()
    eos = sorted(eos_ids) or None
    own = getattr(tokenizer, "transformers_tokenizer", None)  # a GGUF's tokenizer: transformers' own, built now
    if callable(own):
        tokenizer = own()
    try:
        from transformers import PreTrainedTokenizerFast

        if isinstance(tokenizer, PreTrainedTokenizerFast):
            import llguidance.hf

            return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ImportError:
        pass
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(tokenizer, vocab_size)), eos_token=eos)


class GrammarMatcher:
    """One request's parser state over its grammar (the request owns it)."""

    def __init__(self, spec: GrammarSpec, ll_tok) -> None:
        self.matcher = _llguidance().LLMatcher(ll_tok, spec.grammar(), log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {self.matcher.get_error()}")
        self.ll_vocab_size = ll_tok.vocab_size

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here (the state is unchanged)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def _mask(self, vocab_size: int) -> torch.Tensor:
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        n = min(self.ll_vocab_size, vocab_size)
        allowed = np.unpackbits(raw, bitorder="little")[:n]  # bit j of byte b: token 8b + j
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[:n] = torch.from_numpy(allowed.astype(bool))
        return out

    def masks(self, path: Sequence[int], vocab_size: int) -> torch.Tensor:
        """[len(path) + 1, vocab_size] the allowed tokens after each prefix of ``path`` (which the
        grammar must allow: a draft cut by ``valid_prefix``); the state is unchanged after."""
        rows = []
        for i in range(len(path) + 1):
            rows.append(self._mask(vocab_size))
            if i < len(path) and not self.matcher.consume_token(path[i]):
                raise RuntimeError(f"the grammar refused draft token {path[i]}: drafts must be cut first")
        if path:
            self.matcher.rollback(len(path))
        return torch.stack(rows)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume the tokens a step took (an end-of-sequence token ends the request instead)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            self.matcher.consume_token(token)
