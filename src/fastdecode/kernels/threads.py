"""How many worker threads the kernels run on, and how an idle worker waits.

The thread pool is OpenMP's (``libgomp``, shared with torch: ``fastdecode.kernels.build``):
``torch.set_num_threads`` sizes it. Its default is the machine's physical cores, whatever
the process may actually use. A worker whose core belongs to someone else turns every
barrier of every pass into a wait for the scheduler (on a 2-core machine busy with a compile,
plain decoding fell from ~70 to 2 tok/s while llama.cpp on one thread kept 108), so the
count follows what the process may use:

* its CPU affinity (``os.sched_getaffinity``: ``taskset``, a container's cpuset);
* its cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
  the smallest along its cgroup path): a quota of 1.5 CPUs runs one thread, as a second
  would be throttled mid-pass;
* never more than torch's own default (physical cores: SMT siblings share the load ports
  a GEMV is bound by).

``--threads`` (``EngineArgs.threads``) overrides all of them.

How an idle worker waits: libgomp spins ``GOMP_SPINCOUNT`` times (300,000 by default: ~5-10
ms of a core) before it sleeps on a futex. Within a pass the next parallel region starts
microseconds later and a short spin catches it; between passes (drafting, sampling, Python)
a long spin burns a core another process, or this one's main thread, needs. Spin briefly,
then sleep: :func:`quiet_openmp_wait` sets ``GOMP_SPINCOUNT`` (libgomp) and ``KMP_BLOCKTIME``
(Intel's runtime) before torch loads its runtime, unless the user chose a wait policy. They
are read once, when the runtime loads: set after ``import torch`` they do nothing.

Nothing here imports torch at import time (``fastdecode --help`` reads the flags).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# ~0.2-0.4 ms of `pause` on current x86 cores: longer than the gaps between a pass's parallel regions
SPIN_COUNT = 10_000
BLOCKTIME_MS = 1


def affinity_cpus(getaffinity: Callable[[int], set[int]] | None = None) -> int:
    """The CPUs this process may run on (its affinity mask; all of them where there is none)."""
    getaffinity = getaffinity or getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return os.cpu_count() or 1
    try:
        return max(1, len(getaffinity(0)))
    except OSError:
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """``root/cgroup_path`` and each of its parents up to ``root``."""
    parts = [p for p in cgroup_path.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")  # "max 100000" or "150000 100000" (quota, period in us)
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or 100_000)
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPUs this process's cgroup quota allows (quota / period, the smallest along its
    cgroup path, v2 or v1); None without a quota (or where none can be read)."""
    text = _read(proc_cgroup)
    if not text:
        return None
    limits: list[float] = []
    for line in text.splitlines():  # "hierarchy-id:controllers:path"
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            directories, read = _ancestors(root, path), _v2_limit
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            mounts = [root / controllers, root / "cpu,cpuacct", root / "cpu"]
            mount = next((m for m in mounts if m.is_dir()), None)
            directories, read = ([] if mount is None else _ancestors(mount, path)), _v1_limit
        else:
            continue
        limits += [limit for limit in map(read, directories) if limit is not None]
    return min(limits) if limits else None


def usable_cpus(
    getaffinity: Callable[[int], set[int]] | None = None,
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
) -> int:
    """The CPUs this process may keep busy: its affinity, within its cgroup quota (whole CPUs, at least one)."""
    cpus = affinity_cpus(getaffinity)
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit + 1e-9)))
    return cpus


def choose_threads(requested: int | None, torch_default: int, usable: int) -> int:
    """The worker thread count: ``requested`` (``--threads``) when given, else torch's default
    (physical cores, or the user's OMP_NUM_THREADS) within the CPUs the process may use."""
    if requested is not None:
        return requested
    return max(1, min(torch_default, usable))


_requested: list[int] = []  # the last explicit count this process asked for (``--threads``)


def apply_threads(requested: int | None = None) -> int:
    """Size torch's (and so the kernels') thread pool: ``requested``, else an explicit count asked
    for earlier in this process, else :func:`choose_threads`' default. Returns the count."""
    import torch

    if requested is not None:
        _requested[:] = [requested]
    elif _requested:
        requested = _requested[0]
    count = choose_threads(requested, torch.get_num_threads(), usable_cpus())
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    return count


def quiet_openmp_wait(environ: MutableMapping[str, str] | None = None, torch_loaded: bool | None = None) -> bool:
    """Make OpenMP's idle workers spin briefly, then sleep (see the module's docstring), unless
    the user chose a wait policy. Returns whether it took effect: only before torch is imported."""
    environ = os.environ if environ is None else environ
    if torch_loaded if torch_loaded is not None else "torch" in sys.modules:
        return False
    chosen = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    if any(name in environ for name in chosen):
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    environ["KMP_BLOCKTIME"] = str(BLOCKTIME_MS)
    return True
