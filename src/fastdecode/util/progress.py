"""A progress bar on stderr for a long loop of known length (``compress``'s layer-by-layer
calibration): rich's bar, drawn only where stderr is a terminal, so piped, logged or captured
output carries no control characters."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def rich_progress(enabled: bool = True, console=None, description: str = "{task.description}", note: bool = False):
    """rich's ``Progress`` with fastdecode's columns (description, bar, done of total, with ``note``
    each task's ``note`` field, elapsed, remaining) on ``console`` (default: stderr's); it draws
    nothing when not ``enabled``."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    notes = (TextColumn("{task.fields[note]}"),) if note else ()
    columns = (
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        *notes,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console or Console(stderr=True), disable=not enabled, transient=False)


@contextmanager
def progress_bar(
    description: str, total: int, enabled: bool | None = None, console=None
) -> Iterator[Callable[[], None]]:
    """Yields ``advance()``, called once a step of ``total``. ``enabled`` None: where stderr is a
    terminal; ``console``: a ``rich.console.Console`` to draw on (default: stderr's)."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        yield lambda: None
        return
    with rich_progress(console=console) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


def track(items: Sequence[T], description: str) -> Iterator[T]:
    """``items`` one after another under a progress bar (:func:`progress_bar`'s, where stderr is a terminal)."""
    with progress_bar(description, len(items)) as advance:
        for item in items:
            yield item
            advance()
