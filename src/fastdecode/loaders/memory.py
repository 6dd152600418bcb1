"""A warning before a model file larger than the memory this process can have is read
(``fastdecode.util.memory`` tells how much that is: the cgroup's limit, MemAvailable)."""

from __future__ import annotations

import os
import sys

from fastdecode.util.memory import available_memory


def warn_if_over_memory(path: str | os.PathLike) -> None:
    """Warn, with the numbers, when a model file is larger than the memory this process can have
    (its weights will be packed into about that much memory), before anything is read."""
    size = os.path.getsize(path)
    limit = available_memory()
    if limit is not None and size > limit.available_bytes:
        print(
            f"fastdecode: warning: {path} is {size / 1e9:.2f} GB but this process can have only "
            f"{limit.available_bytes / 1e9:.2f} GB more ({limit.source}): loading it may fail",
            file=sys.stderr,
        )
