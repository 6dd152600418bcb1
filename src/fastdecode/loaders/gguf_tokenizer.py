"""The tokenizer a GGUF file describes, built by transformers from the file's tokenizer metadata
(no weights are read), and kept in a small cache that later loads read without transformers.

transformers builds it in ``TokenizersBackend`` from ``get_gguf_tokenizer`` (its fast metadata reader)
and ``convert_gguf_tokenizer``; ``AutoTokenizer`` would first rebuild the model's config with gguf-py's
slow ``GGUFReader`` (~6-10 s for a 49k vocabulary), which this skips: the class is the one
``AutoTokenizer`` picks for GGUF files (a test checks they encode alike). The built tokenizer is saved
(a few MB: transformers' ``tokenizer.json`` and config, and the settings :class:`JsonTokenizer` reads)
under the fastdecode cache, keyed by the file's path, size and mtime and the installed transformers'
version (read from its package metadata, which does not import it). A load that finds it reads it back
as a :class:`JsonTokenizer`: the ``tokenizers`` library only, since importing transformers would cost
more than the rest of the load. ``FASTDECODE_NO_CACHE=1`` turns the cache off.
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
_LAYOUT = "json-1"  # what an entry holds: a new layout is a new key, so older entries are left alone


def _cache_dir(path: str) -> Path | None:
    if os.environ.get("FASTDECODE_NO_CACHE"):
        return None
    st = os.stat(path)
    version = importlib.metadata.version("transformers")
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{version}|{_LAYOUT}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _build(path: str, gguf):
    if "tokenizer.ggml.tokens" not in gguf.metadata or "tokenizer.ggml.model" not in gguf.metadata:
        raise ModelLoadError(f"{path}: the GGUF file has no tokenizer metadata (tokenizer.ggml.tokens / .model)")
    p = Path(path)
    with quiet(uses_transformers=True):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        try:
            return TokenizersBackend.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
        except Exception as exc:  # transformers raises bare KeyError/ValueError on a vocabulary it cannot convert
            raise ModelLoadError(
                f"{path}: cannot build the tokenizer from its metadata ({type(exc).__name__}: {exc})"
            ) from None


def gguf_tokenizer(path: str, gguf) -> JsonTokenizer:
    """The tokenizer of GGUF file ``path`` (``gguf``: its :class:`~fastdecode.loaders.gguf_file.GGUFFile`)."""
    cached = _cache_dir(path)
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
