"""Small helpers every command shares: list options, output directories, the error wrapper."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

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


def run_main(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse and dispatch; a FastDecodeError is one line on stderr and exit 1."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except FastDecodeError as exc:
        print(f"fastdecode: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fastdecode: interrupted", file=sys.stderr)
        return 130
