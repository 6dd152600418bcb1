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

* the cores other processes leave free (:class:`FreeCores`: the per-CPU busy time of
  ``/proc/stat`` over a window, less this process's own CPU time - not the load average,
  which remembers a minute that is gone): a core counts as free when other processes leave
  at least ``1 - FREE_CORE_SLACK`` of it idle. A thread too many costs far more than one too
  few: on 2 cores with one busy process, 2 threads decoded 20.7 tok/s and 1 thread 248
  (docs/benchmarks.md), while an idle machine's second thread gains well under 2x. So the
  rule is: ``threads = max(1, min(torch's default, usable CPUs, floor(free + FREE_CORE_SLACK)))``.

``--threads`` (``EngineArgs.threads``) overrides all of them, and then nothing changes it.

Without it the count follows the machine while the engine runs: :func:`adapt_threads`, called
by the engine before each step, measures the free cores again over the last
``ADAPT_EVERY_S`` (a file read, no waiting) and re-sizes the pool of the thread that runs the
kernels - at once when cores were taken, after ``RAISE_AFTER`` agreeing readings when they
came back. Output never depends on the count: every kernel gives a row the same bits on any
number of threads (tests/kernels: the GEMMs, attention, the block formats, the cache rows; and
tests/kernels/test_threads.py: a generation whose count changes every step).

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
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_STAT = Path("/proc/stat")
FREE_CORE_SLACK = 0.25  # a core is free when other processes use less than this fraction of it
MIN_WINDOW_S = 0.1  # the shortest window a free-core reading is taken over (/proc/stat ticks are 10 ms)
STARTUP_WINDOW_S = 0.15  # the wait for the first reading when the process has not lived that long
FRESH_S = 3.0  # sizing the pool: a reading over a longer window is taken again (STARTUP_WINDOW_S)
ADAPT_EVERY_S = 1.0  # at run time: a reading at most this often
RAISE_AFTER = 2  # readings in a row that must find more free cores before the count goes up
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


@dataclass(frozen=True)
class CpuSnapshot:
    """The CPUs' busy and total clock ticks since boot (``/proc/stat``), this process's own CPU
    time (its children's that ended included: a kernel compile) and the wall clock, at one moment."""

    busy_ticks: int
    total_ticks: int
    own_cpu_s: float
    wall_s: float


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class FreeCores:
    """The cores other processes leave idle, over the window between two snapshots.

    ``cpus``: the CPU ids this process may run on (its affinity; all of them where None). Others'
    busy cores = (the CPUs' busy ticks - this process's own CPU time) / the window, so the
    process's own threads never count against it (only what the others took while they ran)."""

    def __init__(
        self,
        cpus: set[int] | None = None,
        stat: Path = PROC_STAT,
        own_cpu_s: Callable[[], float] = _own_cpu_s,
        clock: Callable[[], float] = time.monotonic,
        ticks_per_s: float | None = None,
    ) -> None:
        self.cpus, self.stat, self.own_cpu_s, self.clock = cpus, stat, own_cpu_s, clock
        self.ticks_per_s = ticks_per_s or _clock_ticks()
        self.num_cpus = 0  # CPUs the last snapshot read

    def snapshot(self) -> CpuSnapshot | None:
        """None where ``/proc/stat`` cannot be read (not Linux)."""
        text = _read(self.stat)
        if not text:
            return None
        busy = total = count = 0
        for line in text.splitlines():  # "cpu3 user nice system idle iowait irq softirq steal ..."
            name, *fields = line.split() if line.startswith("cpu") else ("", "")
            if not name[3:].isdigit():  # (the "cpu" line sums them all)
                continue
            if self.cpus is not None and int(name[3:]) not in self.cpus:
                continue
            ticks = [int(f) for f in fields[:8]]  # (guest time is inside user already)
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            busy += sum(ticks) - idle
            total += sum(ticks)
            count += 1
        if count == 0:
            return None
        self.num_cpus = count
        return CpuSnapshot(busy, total, self.own_cpu_s(), self.clock())

    def free(self, before: CpuSnapshot, after: CpuSnapshot) -> float:
        """Cores that other processes left idle between the two snapshots (0 .. num_cpus)."""
        n = self.num_cpus
        total = after.total_ticks - before.total_ticks
        if total <= 0 or n == 0:
            return float(n)
        own_ticks = (after.own_cpu_s - before.own_cpu_s) * self.ticks_per_s
        others = n * max(0.0, after.busy_ticks - before.busy_ticks - own_ticks) / total
        return max(0.0, n - others)


def _clock_ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def choose_threads(requested: int | None, torch_default: int, usable: int, free: float | None = None) -> int:
    """The worker thread count: ``requested`` (``--threads``) when given, else torch's default
    (physical cores, or the user's OMP_NUM_THREADS) within the CPUs the process may use and the
    cores other processes leave free (``free``, when measured: a core counts when others use
    less than FREE_CORE_SLACK of it)."""
    if requested is not None:
        return requested
    count = min(torch_default, usable)
    if free is not None:
        count = min(count, math.floor(free + FREE_CORE_SLACK))
    return max(1, count)


@dataclass
class _Pool:
    """This process's thread count: what was asked for, what was chosen, and the last reading."""

    requested: int | None = None  # an explicit count asked for earlier in this process (``--threads``)
    ceiling: int | None = None  # torch's count when first sized (physical cores, or OMP_NUM_THREADS)
    usable: int = 1
    count: int | None = None  # the count chosen without a request (None: not chosen automatically)
    monitor: FreeCores | None = None
    since: CpuSnapshot | None = None  # the start of the current reading's window
    free: float | None = None  # the last reading
    raise_votes: int = 0
    next_check_s: float = 0.0


_pool = _Pool()
_local = threading.local()  # per thread: the count its OpenMP runtime was last given (it is per thread)


def _start_window() -> None:
    if _pool.monitor is None:
        cpus = None
        if hasattr(os, "sched_getaffinity"):
            try:
                cpus = set(os.sched_getaffinity(0))
            except OSError:
                cpus = None
        _pool.monitor = FreeCores(cpus)
        _pool.since = _pool.monitor.snapshot()


_start_window()  # the first window opens when this module loads (the CLI: before torch loads)


def free_cores(wait: bool = True, max_age_s: float = FRESH_S) -> float | None:
    """The cores other processes leave free, measured since the last reading (or since this
    module loaded). A window shorter than MIN_WINDOW_S gives the last reading; with ``wait``,
    a window older than ``max_age_s`` (a machine that may be gone) is opened again, and one
    shorter than STARTUP_WINDOW_S with no reading before it waited out. None where it cannot be
    measured."""
    monitor, since = _pool.monitor, _pool.since
    if monitor is None or since is None:
        return None
    age = monitor.clock() - since.wall_s
    stale = wait and age > max_age_s
    if stale:
        since, age = monitor.snapshot() or since, 0.0
    if age < MIN_WINDOW_S and _pool.free is not None and not stale:
        return _pool.free
    if age < STARTUP_WINDOW_S and wait:
        time.sleep(STARTUP_WINDOW_S - age)
    elif age < MIN_WINDOW_S:
        return _pool.free
    after = monitor.snapshot()
    if after is None:
        return _pool.free
    _pool.free, _pool.since = monitor.free(since, after), after
    return _pool.free


def _now() -> float:
    return _pool.monitor.clock() if _pool.monitor is not None else time.monotonic()


def _set(count: int) -> None:
    import torch

    if count != torch.get_num_threads():
        torch.set_num_threads(count)  # (omp_set_num_threads for this thread, and torch's own count)
    _local.count = count


def apply_threads(requested: int | None = None, fresh: bool = False) -> int:
    """Size torch's (and so the kernels') thread pool: ``requested``, else an explicit count asked
    for earlier in this process, else :func:`choose_threads`' default over the free cores
    measured now (``fresh``: over a new window, STARTUP_WINDOW_S; after which :func:`adapt_threads`
    may change it). Returns the count."""
    import torch

    if requested is not None:
        _pool.requested = requested
    if _pool.ceiling is None:
        _pool.ceiling = torch.get_num_threads()
    if _pool.requested is not None:
        _pool.count = None
        _set(_pool.requested)
        return _pool.requested
    _pool.usable = usable_cpus()
    one = min(_pool.ceiling, _pool.usable) == 1  # (nothing to measure)
    _pool.count = choose_threads(
        None, _pool.ceiling, _pool.usable, None if one else free_cores(max_age_s=0.0 if fresh else FRESH_S)
    )
    _pool.raise_votes, _pool.next_check_s = 0, _now() + ADAPT_EVERY_S
    _set(_pool.count)
    return _pool.count


def adapt_threads(now: float | None = None) -> int | None:
    """Between engine steps, in the thread that runs the kernels: follow the free cores (see the
    module's docstring). An explicit count (``--threads``) is only given to this thread (OpenMP's
    count is per thread: a server's engine thread is not the one that sized the pool); a no-op
    where no count was chosen. Returns the count when it set it in this thread."""
    count = _pool.count
    if count is None:
        if _pool.requested is not None and getattr(_local, "count", None) != _pool.requested:
            _set(_pool.requested)
            return _pool.requested
        return None
    now = _now() if now is None else now
    if now >= _pool.next_check_s:
        _pool.next_check_s = now + ADAPT_EVERY_S
        target = choose_threads(None, _pool.ceiling or count, _pool.usable, free_cores(wait=False))
        if target < count:  # cores were taken: a thread too many costs the most
            _pool.count, _pool.raise_votes = target, 0
        elif target > count:  # cores came back: once the readings agree
            _pool.raise_votes += 1
            if _pool.raise_votes >= RAISE_AFTER:
                _pool.count, _pool.raise_votes = target, 0
        else:
            _pool.raise_votes = 0
    if getattr(_local, "count", None) != _pool.count:
        _set(_pool.count)
        return _pool.count
    return None


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
