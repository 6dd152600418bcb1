"""A bounded background load for a benchmark run: N busy processes while it runs.

``fastdecode bench --background-load N`` measures plain and speculative decoding (and the
peers, llama.cpp among them) on a machine whose N cores something else keeps busy, as a
compile or another service would. Each load process spins in pure Python (one core each,
no memory traffic to speak of) and ends by itself when the run ends, when the benchmark
process dies (it watches its parent), or after ``max_s`` seconds, whichever comes first:
the load never outlives the measurement.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# Spins until its parent changes (the benchmark died) or its deadline passes; checked every ~10 ms.
# It says when it starts spinning: the run (and the thread count, which counts free cores) starts after.
_SPIN = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
sys.stdout.write("spinning\\n")
sys.stdout.close()
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(100_000):
        pass
"""
MAX_S = 6 * 3600.0  # a bound on any one run's load, in case neither end nor the parent's death is seen
STOP_TIMEOUT_S = 5.0


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


@contextlib.contextmanager
def background_load(num_processes: int, max_s: float = MAX_S) -> Iterator[list[subprocess.Popen]]:
    """Keep ``num_processes`` busy processes running for the ``with`` block (none for 0)."""
    if num_processes < 0:
        raise ValueError(f"num_processes must be >= 0, got {num_processes}")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(num_processes):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(os.getpid()), str(max_s)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            )
        for proc in procs:
            proc.stdout.readline()  # (empty if it already ended: its deadline passed)
            proc.stdout.close()
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
