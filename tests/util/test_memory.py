"""The memory check before the KV cache is allocated (``util/memory.py``; issue 42, item 2: a
``--kv-cache-gb`` beyond the machine was killed by the OOM killer instead of refused)."""

from __future__ import annotations

import pytest

from fastdecode import Engine
from fastdecode.errors import ConfigError
from fastdecode.util import memory
from fastdecode.util.memory import MemoryLimit, cgroup_memory, mem_available


def test_mem_available_and_cgroup_limits_are_read(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    2048 kB\n")
    assert mem_available(meminfo).available_bytes == 2048 * 1024
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    proc.write_text("0::/a/b\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")  # no limit of its own
    (root / "a" / "memory.max").write_text(f"{3 * 2**30}\n")
    (root / "a" / "memory.current").write_text(f"{2**30}\n")
    limit = cgroup_memory(root, proc)
    assert limit.available_bytes == 2 * 2**30 and "memory.max" in limit.source
    v1 = tmp_path / "v1"
    (v1 / "memory" / "x").mkdir(parents=True)
    proc.write_text("4:memory:/x\n")
    (v1 / "memory" / "x" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory(v1, proc) is None


def test_a_kv_cache_beyond_the_memory_left_is_one_error(tiny_model, tokenizer):
    engine = Engine(tiny_model, tokenizer, kv_cache_gb=1e6)
    with pytest.raises(ConfigError, match=r"the KV cache \(\d+ blocks .* needs [\d.e+]+ GiB but this process can have"):
        engine.generate("hi", max_new_tokens=2)
    assert engine.kv_cache is None and not engine.has_unfinished()


def test_an_allocation_that_fails_anyway_is_the_same_error(tiny_model, tokenizer, monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": None)  # no limit could be read
    engine = Engine(tiny_model, tokenizer, num_kv_blocks=8)

    def fail(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(engine.target, "new_kv_cache", fail)
    with pytest.raises(ConfigError, match="the allocation failed .*lower num_kv_blocks"):
        engine.generate("hi", max_new_tokens=2)


def test_the_default_budget_fits_the_memory_left(tiny_model, tokenizer, monkeypatch):
    per_block = Engine(tiny_model, tokenizer).target.kv_block_bytes(16)
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": MemoryLimit(40 * per_block, "test"))
    monkeypatch.setattr("fastdecode.engine.scheduler.available_memory", memory.available_memory)
    engine = Engine(tiny_model, tokenizer, max_num_seqs=8)  # 8 contexts of 8 blocks would be 64 blocks
    assert engine.scheduler.num_blocks() == 20  # half the memory left
    assert engine.generate("hi", max_new_tokens=2).num_new_tokens == 2
