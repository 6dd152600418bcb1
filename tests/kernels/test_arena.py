"""Packed weights' memory (``kernels/arena.py``): 64-byte aligned tensors carved from 2 MB-aligned
mappings advised as huge pages; tensors never overlap, each keeps its mapping alive, a large one has a
mapping of its own."""

import mmap
import re

import pytest
import torch

from fastdecode.kernels import arena
from fastdecode.kernels.arena import packed_buffer

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


def _flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding ``address`` (Linux's /proc/self/smaps)."""
    current = None
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            current = int(m[1], 16) <= address < int(m[2], 16)
        elif current and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return set()


def test_buffers_are_aligned_disjoint_advised_and_outlive_their_neighbours():
    sizes = [1, 100, 4096, 3 << 20, 77]
    bufs = [packed_buffer(s) for s in sizes]
    assert [b.numel() for b in bufs] == sizes and all(b.dtype == torch.uint8 for b in bufs)
    assert all(b.data_ptr() % 64 == 0 for b in bufs)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert "hg" in _flags(bufs[3].data_ptr())  # madvise(MADV_HUGEPAGE)
    for i, b in enumerate(bufs):
        b.fill_(i)
    del bufs[0], bufs[1]
    assert [int(b[-1]) for b in bufs] == [1, 3, 4]


def test_a_large_buffer_has_a_mapping_of_its_own_aligned_to_a_huge_page():
    big = packed_buffer(arena._CHUNK // 4 + 1)
    assert big.data_ptr() % (2 << 20) == 0 and "hg" in _flags(big.data_ptr())
    assert packed_buffer(0).numel() == 0
