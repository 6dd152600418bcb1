"""Small helpers every command shares: list options, input text, output directories
written whole (never half), the error wrapper."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple, NoReturn

from fastdecode.errors import ConfigError, FastDecodeError


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: "1,3,5" -> (1, 3, 5); at least one integer."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def bounded(
    kind: type, what: str, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Callable[[str], int | float]:
    """An argparse type: ``kind`` (int or float) parsed from the text and kept within
    [low, high] (``low_open``: above low), finite; otherwise one error saying ``what`` was
    expected, e.g. ``bounded(int, "an integer >= 1", low=1)``."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        ok = value == value and abs(value) != float("inf")  # not NaN, finite
        ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = bounded(int, "an integer >= 1", low=1)
positive_float = bounded(float, "a number > 0", low=0, low_open=True)


def draft_tree_arg(text: str) -> int | str:
    """argparse type for ``--draft-tree``: "auto" or a number of paths >= 1."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return value


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


# ---------------------------------------------------------------- the error wrapper


class UsageError(ConfigError):
    """A command line argparse refused: an unknown flag, a missing one, a value of the wrong kind."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one ``fastdecode: error:`` line and exit status 1
    (:func:`run_main`), like every other bad input, instead of argparse's whole usage text (37
    lines for ``generate``) and exit status 2. Its subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def print_notes(notes: Iterable[str]) -> None:
    """Each note as one ``fastdecode: note:`` line on stderr (e.g. ``args.kernel_notes(engine)``)."""
    for note in notes:
        print(f"fastdecode: note: {note}", file=sys.stderr)


def run_main(parser: argparse.ArgumentParser | Callable[[], argparse.ArgumentParser], argv: list[str] | None) -> int:
    """Parse and dispatch; a FastDecodeError (a usage error too) or running out of memory is one
    line on stderr and exit 1, Ctrl-C one line and exit 130. ``parser`` may be a function that
    builds it (its imports can take seconds, and Ctrl-C during them is still one line)."""
    try:
        if callable(parser) and not isinstance(parser, argparse.ArgumentParser):
            parser = parser()
        args = parser.parse_args(argv)
        return args.func(args)
    except FastDecodeError as exc:
        print(f"fastdecode: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError:  # an allocation no check foresaw (the KV cache's is checked before: engine/memory.py)
        print("fastdecode: error: out of memory (a smaller model, --kv-cache-gb or --max-num-seqs)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fastdecode: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`| head`): stop quietly, as other Unix tools do,
        # and keep Python from complaining again when it flushes stdout at exit.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
