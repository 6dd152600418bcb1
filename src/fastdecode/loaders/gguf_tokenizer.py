"""The tokenizer a GGUF file describes, built by transformers from the file's tokenizer metadata
(no weights are read), and kept in a small cache.

transformers builds it in ``TokenizersBackend`` from ``get_gguf_tokenizer`` (its fast metadata reader)
and ``convert_gguf_tokenizer``; ``AutoTokenizer`` would first rebuild the model's config with gguf-py's
slow ``GGUFReader`` (~6-10 s for a 49k vocabulary), which this skips: the class is the one
``AutoTokenizer`` picks for GGUF files (a test checks they encode alike). The built tokenizer is saved
(a few MB: ``tokenizer.json`` and its config) under the fastdecode cache, keyed by the file's path, size
and mtime and transformers' version, so later loads read it back in a fraction of a second.
``FASTDECODE_NO_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from fastdecode.errors import ModelLoadError
from fastdecode.kernels.build import cache_root

_DONE = "fastdecode-complete"


def _cache_dir(path: str) -> Path | None:
    if os.environ.get("FASTDECODE_NO_CACHE"):
        return None
    import transformers

    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _build(path: str, gguf):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if "tokenizer.ggml.tokens" not in gguf.metadata or "tokenizer.ggml.model" not in gguf.metadata:
        raise ModelLoadError(f"{path}: the GGUF file has no tokenizer metadata (tokenizer.ggml.tokens / .model)")
    p = Path(path)
    try:
        return TokenizersBackend.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    except Exception as exc:  # transformers raises bare KeyError/ValueError on a vocabulary it cannot convert
        raise ModelLoadError(
            f"{path}: cannot build the tokenizer from its metadata ({type(exc).__name__}: {exc})"
        ) from None


def gguf_tokenizer(path: str, gguf):
    """The tokenizer of GGUF file ``path`` (``gguf``: its :class:`~fastdecode.loaders.gguf_file.GGUFFile`)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cached = _cache_dir(path)
    if cached is not None and (cached / _DONE).is_file():
        try:  # the class _build made and saved: read back by it, not through AutoTokenizer's model tables
            return TokenizersBackend.from_pretrained(str(cached), local_files_only=True)
        except (OSError, ValueError):
            pass  # a damaged cache entry is rebuilt
    tokenizer = _build(path, gguf)
    if cached is not None:
        _save(tokenizer, cached)
    return tokenizer


def _save(tokenizer, cached: Path) -> None:
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text("ok\n")
        if cached.exists():
            shutil.rmtree(cached)
        tmp.rename(cached)
        tmp = None
    except (OSError, ValueError, RuntimeError):
        pass  # a read-only or full disk only costs the next load its speed
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
