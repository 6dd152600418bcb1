"""The memory this process can have: the cgroup's limit and the kernel's ``MemAvailable``, whichever is
smaller (read from /proc and /sys; psutil would add a dependency for two numbers)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory_bytes() -> int | None:
    """The smaller of the cgroup limit and MemAvailable, in bytes; None where neither can be read."""
    known = [v for v in (_cgroup_limit(), _mem_available()) if v is not None]
    return min(known) if known else None


def warn_if_over_memory(path: str | os.PathLike) -> None:
    """Warn, with the numbers, when a model file is larger than the memory this process can have
    (its weights will be packed into about that much memory), before anything is read."""
    size = os.path.getsize(path)
    have = available_memory_bytes()
    if have is not None and size > have:
        print(
            f"fastdecode: warning: {path} is {size / 1e9:.2f} GB but this process can have only "
            f"{have / 1e9:.2f} GB of memory (cgroup limit / MemAvailable): loading it may fail",
            file=sys.stderr,
        )
