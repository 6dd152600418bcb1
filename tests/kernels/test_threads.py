"""Thread selection: the CPUs a process may use (affinity, cgroup v2 / v1 quota, from fake
files here), ``--threads`` over both, and the OpenMP wait policy set before torch loads."""

from __future__ import annotations

import argparse

import pytest

from fastdecode.args import EngineArgs
from fastdecode.errors import ConfigError
from fastdecode.kernels import threads
from fastdecode.kernels.threads import cgroup_cpu_limit, choose_threads, quiet_openmp_wait, usable_cpus


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
    monkeypatch.setattr(threads, "_requested", [])
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
