"""Files every command reads or writes: input text as UTF-8 (one clear error naming the file
and the byte offset otherwise), and outputs written whole, never half - a directory staged
beside its final place and moved in when complete, a text file renamed over the old one."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from fastdecode.errors import ConfigError

# ---------------------------------------------------------------- input text


def decode_utf8(data: bytes, name: str) -> str:
    """``data`` as text; bytes that are not UTF-8 are one ConfigError naming ``name`` and the
    byte offset. A leading byte-order mark is dropped (it is not content)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        offset = exc.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        raise ConfigError(f"{name}: not UTF-8 text (byte offset {offset})") from None


def read_text(path: str | None, what: str) -> str:
    """The UTF-8 text of the file ``path`` (``None``: stdin) holding the ``what``."""
    if path is None:
        stream = getattr(sys.stdin, "buffer", None)
        return decode_utf8(stream.read(), "<stdin>") if stream is not None else sys.stdin.read()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    return decode_utf8(data, path)


class TextFile(NamedTuple):
    path: str
    text: str


def text_file(path: str) -> TextFile:
    """argparse type: the file ``path`` and its UTF-8 text, not empty; otherwise a usage error."""
    try:
        text = read_text(path, "text file")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path}: the text file is empty")
    return TextFile(path, text)


def check_utf8(text: str, what: str) -> str:
    """``text`` from the command line, refused if it holds bytes that were not UTF-8 (Python
    keeps those as lone surrogates, which no tokenizer accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        offset = len(text[: exc.start].encode("utf-8", "surrogateescape"))
        raise ConfigError(f"{what}: not UTF-8 text (byte offset {offset})") from None
    return text


# ---------------------------------------------------------------- output directories


def writable_dir(path, what: str, allow_nonempty_if: Callable[[Path], bool] | None = None) -> Path:
    """Check, before any long work, that ``path`` can receive ``what``: not a file,
    empty (or accepted by ``allow_nonempty_if``), writable. Creates it."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path}: exists and is not a directory; choose a new or empty directory for the {what}")
    if path.is_dir() and any(path.iterdir()) and not (allow_nonempty_if and allow_nonempty_if(path)):
        raise ConfigError(f"{path}: directory is not empty; choose a new or empty directory for the {what}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".fastdecode-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the {what} there ({exc.strerror or exc})") from None
    return path


def check_output_dir(path, what: str, allow_nonempty_if: Callable[[Path], bool] | None = None) -> Path:
    """:func:`writable_dir`, but leaving nothing behind: the directories it had to create
    for the check are removed again (:func:`staged_dir` creates them when the output is
    complete), so a command that fails or is interrupted later leaves no empty directory."""
    path = Path(path).expanduser()
    created = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    try:
        return writable_dir(path, what, allow_nonempty_if)
    finally:
        for p in created:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()


@contextlib.contextmanager
def staged_dir(final, marker: str | None = None) -> Iterator[Path]:
    """Write a directory's files into a temporary sibling of ``final``; when the block ends
    normally they move into ``final`` (created if absent, files of the same name replaced),
    ``marker`` last; on an error or Ctrl-C the temporary directory is removed and ``final``
    is as it was. A reader that trusts ``marker``'s presence never sees a half-written output:
    an old marker is removed before any file is replaced."""
    final = Path(final).expanduser()
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        blocker = next((p for p in final.parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is not a directory" if blocker is not None else exc.strerror or exc
        raise ConfigError(f"{final}: cannot write there ({reason})") from None
    try:
        yield tmp
        try:
            _publish(tmp, final, marker)
        except OSError as exc:
            raise ConfigError(f"{final}: cannot move the finished output there ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, final: Path, marker: str | None) -> None:
    if not final.exists():
        os.rename(tmp, final)  # one atomic step
        return
    if not final.is_dir():
        raise ConfigError(f"{final}: exists and is not a directory")
    if marker is not None:
        with contextlib.suppress(FileNotFoundError):
            (final / marker).unlink()
    entries = sorted(tmp.iterdir(), key=lambda p: p.name == marker)
    for entry in entries:
        target = final / entry.name
        if entry.is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)


def write_text_atomic(path, text: str) -> None:
    """Write ``path`` whole: into a temporary file beside it, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
