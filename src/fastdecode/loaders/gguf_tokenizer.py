"""The tokenizer a GGUF file describes, built by transformers from the file's tokenizer metadata
(no weights are read), and kept in a small cache that later loads read without transformers.

The cache is keyed by the tokenizer's content, not by the file: a hash of the bytes of the file's
``tokenizer.*`` metadata items (vocabulary, merges, scores, token types, special ids, add_bos/eos, chat
templates) and ``general.architecture`` (transformers picks Gemma's and Phi-3's builders by it), with the
installed transformers' version (read from its package metadata, which does not import it). Every file
sharing a tokenizer (the quantizations of one model, every generated benchmark file) shares one entry;
a file rewritten in place with another tokenizer gets its own. Hashing reads those items' bytes only
(a few MB of the header), so a load that finds its entry reads it back as a :class:`JsonTokenizer`:
the ``tokenizers`` library only, since importing transformers would cost more than the rest of the load.

A build reads the items in full with fastdecode's header reader and hands them to transformers'
converter (``convert_gguf_tokenizer``, what ``TokenizersBackend.from_pretrained(gguf_file=...)`` calls
after its own reader), grouped as its ``get_gguf_tokenizer`` groups them (:func:`_converter_inputs`), and
wraps the result in ``TokenizersBackend``: the class ``AutoTokenizer`` picks for GGUF files (tests check
they encode alike). Unlike ``from_pretrained`` on the file's folder, nothing beside the file (a
``tokenizer.json`` or ``tokenizer_config.json`` lying there) is read: the tokenizer is the content the
key hashes. The entry saved (a few MB: transformers' ``tokenizer.json`` and config, and the settings
:class:`JsonTokenizer` reads) lies under the fastdecode cache. ``FASTDECODE_NO_CACHE=1`` turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path

from fastdecode.errors import ModelLoadError
from fastdecode.kernels.build import cache_root
from fastdecode.loaders.json_tokenizer import SETTINGS_FILE, JsonTokenizer, settings_of
from fastdecode.util.quiet import quiet

_DONE = "fastdecode-complete"
_LAYOUT = "json-2"  # what an entry holds and how it is keyed: a new layout is a new key, older entries are left alone
_ARCH = "general.architecture"
# transformers' get_gguf_tokenizer: a special token's name in the tokenizer's config -> its id's GGUF key
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _tokenizer_keys(gguf) -> list[str]:
    return sorted(key for key in gguf.metadata_spans if key.startswith("tokenizer.") or key == _ARCH)


def tokenizer_digest(gguf) -> str:
    """A hash of what the tokenizer is built from: the file's tokenizer metadata items, byte for byte,
    the installed transformers (which builds it) and the layout of a cache entry."""
    digest = hashlib.sha256(f"{importlib.metadata.version('transformers')}|{_LAYOUT}".encode())
    items = gguf.metadata_bytes(_tokenizer_keys(gguf))
    for raw in (items[key] for key in sorted(items)):
        digest.update(len(raw).to_bytes(8, "little"))  # an item's bytes begin with its key: no two runs alike
        digest.update(raw)
    return digest.hexdigest()


def _cache_dir(gguf) -> Path | None:
    if os.environ.get("FASTDECODE_NO_CACHE"):
        return None
    return cache_root() / "tokenizers" / tokenizer_digest(gguf)[:32]


def _converter_inputs(meta: dict, mapping: dict) -> tuple[str, dict, dict]:
    """``(architecture, tokenizer_dict, tokenizer_config)`` from the file's tokenizer metadata, as
    transformers' ``get_gguf_tokenizer`` makes them from its own reading (``mapping``: its key names)."""
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in mapping.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False  # its chat template writes <bos> itself
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return meta[_ARCH], tokenizer, config


def _build(path: str, gguf):
    if "tokenizer.ggml.tokens" not in gguf.metadata or "tokenizer.ggml.model" not in gguf.metadata:
        raise ModelLoadError(f"{path}: the GGUF file has no tokenizer metadata (tokenizer.ggml.tokens / .model)")
    meta = gguf.read_metadata(_tokenizer_keys(gguf))
    with quiet(uses_transformers=True):
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        try:
            architecture, tokenizer_dict, config = _converter_inputs(meta, GGUF_TOKENIZER_MAPPING)
            backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
            return TokenizersBackend(tokenizer_object=backend, **{**config, **extra})
        except Exception as exc:  # transformers raises bare KeyError/ValueError on a vocabulary it cannot convert
            raise ModelLoadError(
                f"{path}: cannot build the tokenizer from its metadata ({type(exc).__name__}: {exc})"
            ) from None


def gguf_tokenizer(path: str, gguf) -> JsonTokenizer:
    """The tokenizer of GGUF file ``path`` (``gguf``: its :class:`~fastdecode.loaders.gguf_file.GGUFFile`)."""
    cached = _cache_dir(gguf)
    if cached is not None and (cached / _DONE).is_file():
        try:
            return JsonTokenizer.load(cached)
        except Exception:  # noqa: BLE001 (tokenizers raises bare Exception on a damaged file): rebuilt below
            pass
    hf = _build(path, gguf)
    saved = cached is not None and _save(hf, cached)
    return JsonTokenizer.from_transformers(hf, cached if saved else None)


def _save(hf, cached: Path) -> bool:
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        hf.save_pretrained(tmp)
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings_of(hf), ensure_ascii=False, indent=1), encoding="utf-8")
        (tmp / _DONE).write_text("ok\n")
        if cached.exists():
            shutil.rmtree(cached)
        tmp.rename(cached)
        tmp = None
        return True
    except (OSError, ValueError, RuntimeError):
        return False  # a read-only or full disk only costs the next load its speed
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
