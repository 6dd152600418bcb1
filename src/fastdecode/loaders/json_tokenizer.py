"""A tokenizer read from a ``tokenizer.json`` with the ``tokenizers`` library, without transformers.

transformers' ``TokenizersBackend`` is the ``tokenizers.Tokenizer`` it holds plus settings (special
tokens, the chat template, the clean-up rule of ``decode``); importing transformers costs a load over
a second. :class:`JsonTokenizer` is that ``tokenizers.Tokenizer`` with the settings transformers had
settled when it built the tokenizer (``settings_of``), saved beside it as ``SETTINGS_FILE``, and the
calls fastdecode makes on a tokenizer: ``tokenizer(text, add_special_tokens=...)["input_ids"]``,
``decode``, ``batch_decode``, ``apply_chat_template(..., tokenize=False)``, ``get_vocab``,
``convert_ids_to_tokens``, the special ids. Each answers as transformers' would (a test compares
them). What needs transformers' own object (``save_pretrained``, llguidance's ``from_tokenizer``)
gets it from :meth:`JsonTokenizer.transformers_tokenizer`, built on demand.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from fastdecode.loaders.chat_template import render_chat, select_template

SETTINGS_FILE = "fastdecode_tokenizer.json"
FORMAT = 1  # of SETTINGS_FILE; a reader refuses another
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def settings_of(hf) -> dict:
    """What :class:`JsonTokenizer` needs from transformers' tokenizer ``hf``, as JSON."""
    bpe = type(hf.backend_tokenizer.model).__name__ == "BPE"
    force = getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    template = hf.chat_template
    return {
        "format": FORMAT,
        "special_tokens": dict(hf.special_tokens_map),
        "all_special_ids": [None if i is None else int(i) for i in hf.all_special_ids],
        **{name: getattr(hf, name, None) for name in _SPECIAL_IDS},
        "chat_template": template if isinstance(template, (str, dict)) else None,
        # transformers skips the clean-up on BPE models unless forced (it strips real spaces there)
        "clean_up_tokenization_spaces": bool(hf.clean_up_tokenization_spaces) and (not bpe or bool(force)),
        "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
    }


def _clean_up(text: str) -> str:  # transformers' clean_up_tokenization
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for suffix in ("m", "s", "ve", "re"):
        text = text.replace(f" '{suffix}", f"'{suffix}")
    return text


class JsonTokenizer:
    """A ``tokenizers.Tokenizer`` and transformers' settings for it (see the module's docstring)."""

    def __init__(self, backend: Tokenizer, settings: dict, directory: Path | None = None, hf=None) -> None:
        if settings.get("format") != FORMAT:
            raise ValueError(f"tokenizer settings of format {settings.get('format')!r}, expected {FORMAT}")
        backend.no_truncation()  # transformers turns both off on every call that does not ask for them
        backend.no_padding()
        backend.encode_special_tokens = settings["split_special_tokens"]
        self._backend = backend
        self._directory = directory  # where transformers can read it back from (tokenizer.json and its config)
        self._hf = hf
        self.special_tokens_map: dict[str, str] = dict(settings["special_tokens"])
        self.all_special_ids: list[int] = list(settings["all_special_ids"])
        self.chat_template = settings["chat_template"]
        self.clean_up_tokenization_spaces: bool = settings["clean_up_tokenization_spaces"]
        for name in _SPECIAL_IDS:
            setattr(self, name, settings[name])
        for name, token in self.special_tokens_map.items():
            setattr(self, name, token)

    @classmethod
    def load(cls, directory: Path) -> JsonTokenizer:
        """The tokenizer saved in ``directory`` (``tokenizer.json`` and ``SETTINGS_FILE``)."""
        settings = json.loads((directory / SETTINGS_FILE).read_text(encoding="utf-8"))
        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), settings, directory)

    @classmethod
    def from_transformers(cls, hf, directory: Path | None = None) -> JsonTokenizer:
        return cls(Tokenizer.from_str(hf.backend_tokenizer.to_str()), settings_of(hf), directory, hf)

    def transformers_tokenizer(self):
        """transformers' own tokenizer of the same files (imports transformers: only where it is needed)."""
        if self._hf is None:
            if self._directory is None:
                raise ValueError("this tokenizer was not saved: transformers cannot read it back")
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            self._hf = TokenizersBackend.from_pretrained(str(self._directory), local_files_only=True)
        return self._hf

    def save_pretrained(self, directory, **kwargs):
        return self.transformers_tokenizer().save_pretrained(directory, **kwargs)

    # --- the calls fastdecode makes -------------------------------------------------

    def __call__(self, text: str, add_special_tokens: bool = True, **_ignored) -> dict[str, list[int]]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return {"input_ids": self._backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens)["input_ids"]

    def decode(self, token_ids, skip_special_tokens: bool = False, **_ignored) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **_ignored) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def apply_chat_template(self, messages: list, tokenize: bool = True, add_generation_prompt: bool = False):
        text = render_chat(
            select_template(self.chat_template), messages, add_generation_prompt, self.special_tokens_map
        )
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]
