"""The block pool's bookkeeping on its own: allocation, references, freeing, the prefix
cache (keys by whole prefix, LRU eviction), and scratch blocks reused first."""

from __future__ import annotations

import pytest

from fastdecode.errors import ConfigError
from fastdecode.kv.cache import BlockPool, BlockTable


def _cached_request(pool: BlockPool, tokens: list[int]) -> BlockTable:
    table = BlockTable(pool.allocate(pool.blocks_for(len(tokens))))
    pool.register_full_blocks(table, tokens, len(tokens))
    return table


def test_allocate_free_and_reference_counts():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.usage == 0.75
    pool.share(a[:1])
    pool.free(a)
    assert pool.num_free == 3  # a[0] is still held once
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a[:1])
    with pytest.raises(RuntimeError, match="shared while free"):
        pool.share(a[:1])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_prefix_cache_hits_whole_blocks_of_an_identical_prefix_only():
    pool = BlockPool(8, 2)
    table = _cached_request(pool, [1, 2, 3, 4, 5])
    pool.free(table.blocks)
    hit_table = BlockTable()
    assert pool.take_cached_prefix([1, 2, 3, 4, 9, 9], hit_table, 5) == 4
    assert hit_table.blocks == table.blocks[:2]
    miss = BlockTable()
    assert pool.take_cached_prefix([7, 2, 3, 4], miss, 3) == 0  # block (3, 4) after another first block
    assert (pool.prefix_queries_tokens, pool.prefix_hits_tokens) == (10, 4)
    capped = BlockTable()
    assert pool.take_cached_prefix([1, 2, 3, 4], capped, 3) == 2  # at most max_tokens positions


def test_eviction_takes_the_least_recently_freed_block_first():
    pool = BlockPool(3, 2)
    old = _cached_request(pool, [1, 2])
    pool.free(old.blocks)
    new = _cached_request(pool, [3, 4])
    pool.free(new.blocks)
    pool.allocate(2)  # the never-used block, then the older cached one
    assert pool.take_cached_prefix([1, 2, 0], BlockTable(), 2) == 0
    assert pool.take_cached_prefix([3, 4, 0], BlockTable(), 2) == 2


def test_scratch_blocks_are_reused_before_cached_ones_are_evicted():
    pool = BlockPool(4, 2)
    table = _cached_request(pool, [1, 2, 3, 4])
    pool.free(table.blocks)
    for _ in range(10):  # a draft path's scratch block, every step
        pool.free(pool.allocate(1), reuse_first=True)
    assert pool.take_cached_prefix([1, 2, 3, 4, 5], BlockTable(), 4) == 4


def test_disabled_prefix_cache_counts_queries_but_never_hits():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    table = _cached_request(pool, [1, 2, 3, 4])
    pool.free(table.blocks)
    assert pool.take_cached_prefix([1, 2, 3, 4], BlockTable(), 4) == 0
    assert pool.prefix_queries_tokens == 4


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0), (True, 16), (2.5, 16)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ConfigError):
        BlockPool(num_blocks, block_size)
