"""What every command shares: argparse value types (lists, bounded numbers, ``--draft-tree``),
notes on stderr, and the error wrapper (a FastDecodeError is one line and exit 1). Reading input
text and writing outputs whole are in :mod:`fastdecode.util.files`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import NoReturn

from fastdecode.errors import ConfigError, FastDecodeError


class UsageError(ConfigError):
    """A command line argparse refused: an unknown flag, a missing one, a value of the wrong kind."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one ``fastdecode: error:`` line and exit status 1
    (:func:`run_main`), like every other bad input, instead of argparse's whole usage text (37
    lines for ``generate``) and exit status 2. Its subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


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


def positive_int_or_off(text: str) -> int | None:
    """argparse type: an integer >= 1, or 0 for none (None)."""
    return bounded(int, "an integer >= 0 (0: off)", low=0)(text) or None


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


# ---------------------------------------------------------------- the error wrapper


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
    except MemoryError:  # an allocation no check foresaw (the KV cache's is checked before: util/memory.py)
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
