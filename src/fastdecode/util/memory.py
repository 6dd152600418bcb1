"""The memory this process can still have, checked before a large allocation is attempted.

A size the machine cannot hold (``--kv-cache-gb 1e6``) must be one clear error naming the
numbers, not minutes of allocation ended by the kernel's OOM killer, which on a shared host may
kill another process instead. The KV cache is allocated uninitialized (its pages are touched only
as requests fill it), so an oversized one would not even fail at once: it would fail later, mid
request. Hence the check before, against the smallest of:

* ``MemAvailable`` in ``/proc/meminfo``: what the kernel estimates can be allocated without swapping;
* for each cgroup on this process's path (v2: ``memory.max``; v1: the memory controller's
  ``memory.limit_in_bytes``), its limit less its current usage: a container's limit is hit before
  the host's memory runs out;
* on a GPU, the free device memory (``torch.cuda.mem_get_info``).

Where none can be read (another OS), the check passes and the allocation itself is guarded:
:func:`guarded_allocation` turns its ``MemoryError`` (or torch's "can't allocate" ``RuntimeError``)
into the same error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdecode.errors import ConfigError

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
GIB = 2**30
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)


@dataclass(frozen=True)
class MemoryLimit:
    """How many more bytes this process can have, and which limit says so."""

    available_bytes: int
    source: str  # e.g. "MemAvailable in /proc/meminfo", "cgroup memory.max of /sys/fs/cgroup/user.slice"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None  # "max": no limit


def mem_available(meminfo: Path = MEMINFO) -> MemoryLimit | None:
    for line in (_read(meminfo) or "").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            kib = _int(value.split()[0]) if value.split() else None
            return None if kib is None else MemoryLimit(kib * 1024, f"MemAvailable in {meminfo}")
    return None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[Path, str, str]]:
    """(directory, limit file, usage file) for each memory cgroup on this process's path, innermost first."""
    out = []
    for line in (_read(proc_cgroup) or "").splitlines():  # "hierarchy-id:controllers:path"
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        parts = [p for p in path.split("/") if p]
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own mount
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        out += [(base.joinpath(*parts[:i]), *files) for i in range(len(parts), -1, -1)]
    return out


def cgroup_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> MemoryLimit | None:
    """The tightest cgroup memory limit on this process's path, less that cgroup's usage (None: no limit)."""
    best: MemoryLimit | None = None
    for directory, limit_file, usage_file in _cgroup_dirs(root, proc_cgroup):
        limit = _int(_read(directory / limit_file))
        if limit is None or limit >= UNLIMITED:
            continue
        usage = _int(_read(directory / usage_file)) or 0
        left = max(0, limit - usage)
        if best is None or left < best.available_bytes:
            best = MemoryLimit(
                left, f"cgroup {limit_file} of {directory}: {limit / GIB:.3g} GiB, {usage / GIB:.3g} in use"
            )
    return best


def available_memory(device: torch.device | str = "cpu") -> MemoryLimit | None:
    """The most this process can still allocate on ``device`` (None: nothing could be read)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():  # (loading says so, with its own error)
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return MemoryLimit(int(free), f"free memory of {device}")
    limits = [m for m in (mem_available(), cgroup_memory()) if m is not None]
    return min(limits, key=lambda m: m.available_bytes) if limits else None


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB"


def check_fits(nbytes: int, what: str, hint: str, device: torch.device | str = "cpu") -> None:
    """One ConfigError, with the numbers, if ``nbytes`` more bytes do not fit what this process can have."""
    limit = available_memory(device)
    if limit is not None and nbytes > limit.available_bytes:
        raise ConfigError(
            f"{what} needs {gib(nbytes)} but this process can have {gib(limit.available_bytes)} more "
            f"({limit.source}): {hint}"
        )


@contextlib.contextmanager
def guarded_allocation(nbytes: int, what: str, hint: str, device: torch.device | str = "cpu") -> Iterator[None]:
    """Check that ``nbytes`` fit (:func:`check_fits`), then allocate in the block: an allocation that
    fails anyway (a limit nothing could read) is the same one ConfigError."""
    check_fits(nbytes, what, hint, device)
    try:
        yield
    except MemoryError:
        raise ConfigError(f"{what} needs {gib(nbytes)}: the allocation failed (out of memory): {hint}") from None
    except RuntimeError as exc:  # torch: "DefaultCPUAllocator: can't allocate memory", "CUDA out of memory"
        if "alloc" not in str(exc) and "out of memory" not in str(exc):
            raise
        raise ConfigError(f"{what} needs {gib(nbytes)}: the allocation failed ({str(exc)[:120]}): {hint}") from None
