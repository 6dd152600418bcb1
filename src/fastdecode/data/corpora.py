"""The texts shipped with fastdecode: one to evaluate on, one to calibrate on.

Both are read from the package (``data/``), never from the network. Their sources and
licences are in the README beside each file.

- ``evaluation_text()``: the WikiText-2 raw test split, joined as the GPTQ, SparseGPT and
  Wanda evaluation code joins it (``"\\n\\n".join(rows)``, blank rows empty).
- ``calibration_text()``: the first 150 KB of Tiny Shakespeare, wholly apart from the
  evaluation text (no vendored copy of the WikiText-2 raw train split could be found).
"""

from __future__ import annotations

import functools
from importlib import resources

EVALUATION_FILE = "data/wikitext-2-raw/wiki.test.raw"
CALIBRATION_FILE = "data/tinyshakespeare/calibration.txt"


def _read(path: str) -> str:
    return resources.files("fastdecode").joinpath(path).read_text(encoding="utf-8")


def join_rows(raw: str) -> str:
    """WikiText file lines -> the text the papers score.

    The Hugging Face loader turns each line of ``wiki.*.raw`` into one row, a blank line
    (a single space) into ``""``; the evaluation code then joins the rows with blank lines.
    Example: ``" \\n = A = \\n \\n B \\n"`` -> ``"\\n\\n = A = \\n\\n\\n\\n\\n B \\n"``.
    """
    rows = [line if line.strip() else "" for line in raw.splitlines(keepends=True)]
    return "\n\n".join(rows)


@functools.cache
def evaluation_text() -> str:
    """The WikiText-2 raw test split, rows joined with blank lines (1,294,336 characters)."""
    return join_rows(_read(EVALUATION_FILE))


@functools.cache
def calibration_text() -> str:
    """A short calibration text kept apart from the evaluation text (150,006 characters)."""
    return _read(CALIBRATION_FILE)
