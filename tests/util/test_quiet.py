"""``util.quiet``: transformers' output hushed inside the block, never imported for it, and, when first
imported inside, its later warnings still reach the real stderr (a fresh process: the import is the point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fastdecode

_CHILD = """
import sys
from fastdecode.util.quiet import quiet
with quiet():
    pass
print("imported by an empty block:", "transformers" in sys.modules)
with quiet():
    from transformers.utils import logging
    logging.get_logger("transformers.probe").warning("inside")
logging.get_logger("transformers.probe").warning("after")
with quiet():
    logging.get_logger("transformers.probe").warning("inside again")
    print("level inside:", logging.get_verbosity())
print("level after:", logging.get_verbosity())
"""


def test_quiet_imports_nothing_and_hands_stderr_back():
    src = str(Path(fastdecode.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "imported by an empty block: False" in run.stdout
    assert "after" in run.stderr and "inside" not in run.stderr
    assert "level inside: 40" in run.stdout and "level after: 30" in run.stdout  # ERROR inside, WARNING restored
