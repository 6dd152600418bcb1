"""Paged-cache checks several test files share (imported by name: tests/ is on sys.path via its conftest)."""

import torch

from fastdecode.backends.base import BatchEntry, PagedSequence
from fastdecode.kv.cache import BlockTable
from fastdecode.kv.policy import compact

MOVED_TOKENS = [5, 9, 13, 40, 41, 42, 7]


def assert_verify_equals_decode(executor, n: int) -> None:
    """A verification pass of ``n`` rows gives, bit for bit, the logits of ``n`` one-row decode steps."""
    target = PagedSequence(executor)
    prompt = list(range(3, 40))
    target.forward(prompt, 1)
    drafts = list(range(50, 50 + n))
    verify = target.forward(drafts, n)
    target.truncate(len(prompt))
    assert torch.equal(verify, torch.cat([target.forward([t], 1) for t in drafts]))


def moved_and_direct(target):
    """:data:`MOVED_TOKENS` written at slots 3..9 and compacted to 0..6 (``moved``, its block table),
    and written straight at slots 0..6 (``direct``, blocks [0, 1]): caches of 4 blocks of 4."""
    moved, direct = target.new_kv_cache(4, 4), target.new_kv_cache(4, 4)
    table = BlockTable(moved.pool.allocate(3))
    target.forward_batch(moved, [BatchEntry([3, 3, 3, *MOVED_TOKENS], 0, table.blocks, 1)])  # slots 3..9
    target.forward_batch(direct, [BatchEntry(MOVED_TOKENS, 0, [0, 1], 1)])  # slots 0..6
    compact(target, moved, table, keep=list(range(3, 10)))  # slots 3..9 -> 0..6
    return moved, direct, table
