"""Thread selection: the CPUs a process may use (affinity, cgroup v2 / v1 quota, from fake
files here), the cores other processes leave free (a fake /proc/stat and clocks), ``--threads``
over all of them, the count following the free cores at run time without changing a token,
and the OpenMP wait policy set before torch loads."""

from __future__ import annotations

import argparse

import pytest

from fastdecode.args import EngineArgs
from fastdecode.errors import ConfigError
from fastdecode.kernels import threads
from fastdecode.kernels.threads import (
    CpuSnapshot,
    FreeCores,
    cgroup_cpu_limit,
    choose_threads,
    quiet_openmp_wait,
    usable_cpus,
)


def _affinity(n: int):
    return lambda pid: set(range(n))


def _cgroup_v2(tmp_path, cpu_max: str | None, path: str = "/user.slice/app.scope"):
    root = tmp_path / "cgroup"
    (root / path.strip("/")).mkdir(parents=True)
    if cpu_max is not None:
        (root / path.strip("/") / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_affinity_alone_sets_the_cpus(tmp_path):
    root, proc = _cgroup_v2(tmp_path, "max 100000")  # no quota
    assert usable_cpus(_affinity(3), root, proc) == 3
    assert usable_cpus(_affinity(3), tmp_path / "none", tmp_path / "missing") == 3  # nothing readable


def test_a_cgroup_v2_quota_caps_the_cpus(tmp_path):
    root, proc = _cgroup_v2(tmp_path, "150000 100000")  # 1.5 CPUs: one thread, a second would be throttled
    assert cgroup_cpu_limit(root, proc) == 1.5
    assert usable_cpus(_affinity(8), root, proc) == 1
    # the smallest quota along the path counts: a parent's
    (root / "user.slice" / "app.scope" / "cpu.max").write_text("max 100000\n")
    (root / "user.slice" / "cpu.max").write_text("200000 100000\n")
    assert usable_cpus(_affinity(8), root, proc) == 2
    root, proc = _cgroup_v2(tmp_path / "small", "50000 100000")  # half a CPU: still one thread
    assert usable_cpus(_affinity(8), root, proc) == 1


def test_a_cgroup_v1_cfs_quota_caps_the_cpus(tmp_path):
    root = tmp_path / "cgroup"
    group = root / "cpu,cpuacct" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("300000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(root, proc) == 3.0
    assert usable_cpus(_affinity(16), root, proc) == 3
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert usable_cpus(_affinity(16), root, proc) == 16


def test_threads_default_within_the_usable_cpus_and_the_option_overrides_both(tmp_path):
    root, proc = _cgroup_v2(tmp_path, "100000 100000")
    usable = usable_cpus(_affinity(2), root, proc)
    assert choose_threads(None, torch_default=4, usable=usable) == 1
    assert choose_threads(None, torch_default=2, usable=8) == 2  # never above torch's own default (physical cores)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), groups=("model",))
    args = EngineArgs.from_cli_args(parser.parse_args(["--threads", "3"]))
    assert args.threads == 3
    assert choose_threads(args.threads, torch_default=4, usable=usable) == 3
    assert EngineArgs.from_cli_args(parser.parse_args([])).threads is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])
    with pytest.raises(ConfigError, match="threads"):
        EngineArgs(threads=0).validate()


def test_apply_threads_keeps_an_explicit_count_for_later_targets(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_pool", threads._Pool(ceiling=2))
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
    try:
        assert threads.apply_threads(None) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert threads.apply_threads(2) == 2  # --threads over the usable CPUs
        assert threads.apply_threads(None) == 2  # a later target of the same run keeps it
    finally:
        torch.set_num_threads(before)


def test_the_openmp_wait_policy_is_set_only_before_torch_loads_and_only_when_not_chosen():
    env: dict[str, str] = {}
    assert quiet_openmp_wait(env, torch_loaded=False)
    assert env["GOMP_SPINCOUNT"] == str(threads.SPIN_COUNT)
    assert not quiet_openmp_wait({}, torch_loaded=True)  # read once when the runtime loads: too late
    chosen = {"OMP_WAIT_POLICY": "active"}
    assert not quiet_openmp_wait(chosen, torch_loaded=False) and "GOMP_SPINCOUNT" not in chosen


def _stat(path, per_cpu: list[tuple[int, int]]) -> None:
    """A /proc/stat whose CPUs have these (busy, idle) ticks (busy as user time)."""
    total_busy, total_idle = sum(b for b, _ in per_cpu), sum(i for _, i in per_cpu)
    lines = [f"cpu  {total_busy} 0 0 {total_idle} 0 0 0 0 0 0"]
    lines += [f"cpu{n} {b} 0 0 {i} 0 0 0 0 0 0" for n, (b, i) in enumerate(per_cpu)]
    path.write_text("\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n")


def test_free_cores_count_what_other_processes_leave_idle_not_this_process(tmp_path):
    stat, own = tmp_path / "stat", [0.0]
    monitor = FreeCores(None, stat, own_cpu_s=lambda: own[0], clock=lambda: 0.0, ticks_per_s=100)
    _stat(stat, [(1000, 5000), (1000, 5000)])
    before = monitor.snapshot()
    assert monitor.num_cpus == 2
    # one second: another process kept CPU 1 busy, CPU 0 was idle -> one core free
    _stat(stat, [(1000, 5100), (1100, 5000)])
    assert monitor.free(before, monitor.snapshot()) == pytest.approx(1.0)
    # this process itself kept CPU 0 busy (its own time is not someone else's) -> still one free
    own[0] = 1.0
    _stat(stat, [(1100, 5100), (1200, 5000)])
    assert monitor.free(before, monitor.snapshot()) == pytest.approx(1.0, abs=0.01)
    # only the CPUs of its affinity count: CPU 0 alone, idle to others
    mine = FreeCores({0}, stat, own_cpu_s=lambda: 0.0, clock=lambda: 0.0, ticks_per_s=100)
    a = CpuSnapshot(1000, 6000, 0.0, 0.0)
    b = mine.snapshot()
    assert mine.num_cpus == 1 and mine.free(a, CpuSnapshot(1000, 6100, 0.0, 1.0)) == 1.0
    assert b.busy_ticks == 1100 and mine.free(a, CpuSnapshot(1100, 6100, 0.0, 1.0)) == 0.0
    assert FreeCores(None, tmp_path / "missing").snapshot() is None  # not Linux: no reading


def test_the_default_counts_free_cores_and_the_option_overrides_it():
    assert choose_threads(None, torch_default=2, usable=2, free=2.0) == 2
    assert choose_threads(None, torch_default=2, usable=2, free=1.0) == 1  # one busy process: one thread
    assert choose_threads(None, torch_default=2, usable=2, free=1.7) == 1  # others hold 30% of a core: not free
    assert choose_threads(None, torch_default=2, usable=2, free=1.8) == 2
    assert choose_threads(None, torch_default=8, usable=8, free=0.0) == 1  # never fewer than one
    assert choose_threads(None, torch_default=2, usable=2, free=None) == 2  # not measured: the usable CPUs
    assert choose_threads(2, torch_default=2, usable=2, free=0.0) == 2  # --threads: whatever the load


class _FakeMonitor:
    """Readings of free cores handed out in order, one per window (the clock is the test's)."""

    def __init__(self, readings: list[float]) -> None:
        self.readings, self.now = list(readings), 0.0

    def clock(self) -> float:
        return self.now

    def snapshot(self) -> CpuSnapshot:
        return CpuSnapshot(0, 0, 0.0, self.now)

    def free(self, before: CpuSnapshot, after: CpuSnapshot) -> float:
        return self.readings.pop(0)


def test_at_run_time_the_count_drops_at_once_and_rises_only_when_readings_agree(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monitor = _FakeMonitor([2.0, 1.0, 2.0, 1.0, 2.0, 2.0, 2.0])
    pool = threads._Pool(ceiling=2, monitor=monitor, since=monitor.snapshot())
    monkeypatch.setattr(threads, "_pool", pool)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(threads, "_local", threads.threading.local())
    counts = []

    def tick(t: float) -> None:
        monitor.now = t
        threads.adapt_threads(now=t)
        counts.append(torch.get_num_threads())

    try:
        monitor.now = 0.2
        assert threads.apply_threads(None) == 2  # first reading: 2 free
        for t in (0.5, 1.3, 2.4, 3.5, 4.6, 5.7):  # readings at 1.3 s on: 1, 2, 1, 2, 2 free
            tick(t)
        # 0.5: within the check interval; 1.3: a core taken -> 1 at once; 2.4: one reading of 2 -> wait;
        # 3.5: taken again; 4.6, 5.7: two readings of 2 in a row -> back to 2
        assert counts == [2, 1, 1, 1, 1, 2]
        monitor.now = 100.0
        assert threads.adapt_threads(now=100.0) is None and torch.get_num_threads() == 2
        # an explicit count: nothing changes it
        assert threads.apply_threads(1) == 1
        assert threads.adapt_threads(now=200.0) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_tokens_do_not_depend_on_the_thread_count_changing_between_steps(
    tiny_model, tokenizer, monkeypatch, linear_pass_costs
):
    """The engine re-sizes the pool between steps (adapt_threads); the kernels give a row the same
    bits on any number of threads, so a generation whose count changes every step (1, 2, 3) gives
    plain decoding's tokens on one thread, speculative and batched alike."""
    import torch

    from fastdecode import Engine, build_drafter
    from fastdecode.engine import core

    prompts = [[1] + [20, 21, 22, 23] * 5, [1, 30, 31, 40, 41, 30, 31, 40]]
    before = torch.get_num_threads()
    plain = [Engine(tiny_model, tokenizer).generate(p, max_new_tokens=40).token_ids for p in prompts]
    counts = iter([1, 2, 3] * 1000)
    monkeypatch.setattr(core, "adapt_threads", lambda: torch.set_num_threads(next(counts)))
    try:
        engine = Engine(tiny_model, tokenizer, drafter=build_drafter("ngram"))
        # (fixed pass costs, no guard: whether drafts pay on the tiny model is timing noise; they must be verified here)
        ids = [engine.add_request(p, max_new_tokens=40, draft_k=4, speculation_guard=False) for p in prompts]
        requests = [engine.get_request(i) for i in ids]
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.set_num_threads(before)
    assert [r.result.token_ids for r in requests] == plain
    assert sum(r.result.acceptance.accepted_tokens for r in requests) > 0  # (it did speculate)


def test_a_gemm_row_gets_the_same_bits_on_three_threads():
    import torch

    from fastdecode.kernels import cpu

    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(203, 64, generator=gen), torch.randn(7, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.rowgemm(x, w)
        torch.set_num_threads(3)  # an odd count: each thread's share of the columns is uneven
        three = cpu.rowgemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)


def test_a_reading_is_taken_over_a_window_long_enough_and_fresh_enough(monkeypatch):
    """free_cores: a window under MIN_WINDOW_S gives the last reading; the first reading of a
    young process waits out STARTUP_WINDOW_S; sizing the pool after a long quiet spell (a window
    over FRESH_S) opens a new window rather than average the past in."""
    monitor = _FakeMonitor([1.0, 2.0, 0.5])
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 3))
        monitor.now += seconds

    monkeypatch.setattr(threads, "_pool", threads._Pool(monitor=monitor, since=monitor.snapshot()))
    monkeypatch.setattr(threads.time, "sleep", sleep)
    monitor.now = 0.05
    assert threads.free_cores() == 1.0 and slept == [0.1]  # young: waited to STARTUP_WINDOW_S
    monitor.now += 0.05
    assert threads.free_cores(wait=False) == 1.0  # too short a window: the last reading
    monitor.now += 1.0
    assert threads.free_cores(wait=False) == 2.0  # the engine's reading: the window since the last one
    monitor.now += 100.0
    assert threads.free_cores() == 0.5 and slept[-1] == threads.STARTUP_WINDOW_S  # stale: a new window
