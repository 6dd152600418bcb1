"""Packed weights' memory in transparent huge pages: :func:`packed_buffer`.

A decode pass streams every weight once, so how fast memory reads go is how fast decoding goes; and a
read stream over 4 KB pages runs ~20% slower than one over 2 MB pages on the 2-vCPU Zen 3 (one run of a
two-thread read loop: ~12-13 GB/s against ~16-21). Linux backs anonymous memory with huge pages, in its
"madvise" mode, only where asked and only in 2 MB-aligned spans; a packed tensor of its own (torch's
allocator: page-aligned; ``quant_pack.c`` used to advise only outputs of 4 MB and more) got none below
that: an OLMoE's experts (one 1.7-2.4 MB tensor each) sat 97% in 4 KB pages. The hint also speeds the
packing: the first touch of each 4 KB page - a fault and its zeroing - cost as much as the packing itself
(Q4_K [32768, 2048], one thread, CPU time on a loaded machine: ~1.7 GB/s into pages already touched,
~0.65 into fresh ones, ~1.3 with the hint). Here packed tensors are carved, 64-byte
aligned, out of large anonymous mappings aligned to 2 MB and advised as huge (Python's ``mmap``: neither
torch nor the standard library allocates so), each a view that keeps its mapping alive; a mapping is
unmapped when its last tensor goes. The untouched tail of a mapping costs address space only (anonymous
pages are not resident until written). Where the platform has no ``MADV_HUGEPAGE`` (not Linux), torch's
allocator serves.
"""

from __future__ import annotations

import mmap
import threading

import torch

__all__ = ["packed_buffer"]

_HUGE = 2 << 20  # a huge page (x86-64)
_CHUNK = 256 << 20  # a mapping's size; a tensor above a quarter of it gets its own
_ALIGN = 64  # the kernels' alignment

_lock = threading.Lock()
_open: list = []  # [mapping as uint8 tensor, next free offset]: the mapping tensors are carved from


def _mapping(size: int) -> tuple[torch.Tensor, int]:
    """A fresh anonymous mapping of ``size`` bytes advised as huge pages, as a uint8 tensor, and the offset
    of its first 2 MB boundary."""
    m = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping: unmapped when its last view goes
    return t, -t.data_ptr() % _HUGE


def packed_buffer(size: int) -> torch.Tensor:
    """A uint8 tensor of ``size`` bytes, 64-byte aligned, in memory advised as huge pages (contents
    undefined, as ``torch.empty``'s)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or size <= 0:
        return torch.empty(max(size, 0), dtype=torch.uint8)
    if size > _CHUNK // 4:
        t, at = _mapping(size)
        return t[at : at + size]
    with _lock:
        if not _open or _open[1] + size > _open[0].numel():
            t, at = _mapping(_CHUNK)
            _open[:] = [t, at]
        t, at = _open
        _open[1] = at + -(-size // _ALIGN) * _ALIGN
        return t[at : at + size]
