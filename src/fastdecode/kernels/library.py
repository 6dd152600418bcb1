"""The loaded C library as the wrappers below ``cpu`` reach it (``ops``, ``layer``).

The loader is :mod:`fastdecode.kernels.cpu`'s (it builds the library on first use,
says why it cannot be had, and is what callers and tests reset); ``cpu`` installs it
here when imported, so the modules it re-exports call the library without importing it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_loader: list[Callable[[], ctypes.CDLL]] = []  # the one installed loader


def install(loader: Callable[[], ctypes.CDLL]) -> None:
    """Make ``loader`` (the library, or RuntimeError saying why it cannot be had) the one :func:`kernel` asks."""
    _loader[:] = [loader]


def kernel() -> ctypes.CDLL:
    """The library with its functions typed; RuntimeError saying why it cannot be had."""
    if not _loader:
        raise RuntimeError("fastdecode.kernels.cpu loads the C library: import it before calling a kernel")
    return _loader[0]()
