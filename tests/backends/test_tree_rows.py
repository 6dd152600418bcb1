"""Token-tree verification in one pass (``BatchEntry.shared``): each node of the tree is a
row once; a path that shares a prefix with an earlier path gets that prefix's keys and
values copied into its own blocks (cpu.c's ``fd_kv_mirror``, or torch indexing) and
computes only its own nodes. Every node's logits must be the bits of a decode step."""

import copy

import pytest
import torch
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode.backends import make_target
from fastdecode.backends.base import BatchEntry

B = 4  # block size: the tree's positions straddle a block boundary


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, **dict(KERNEL_FRIENDLY, max_position_embeddings=256))


PROMPT = list(range(3, 13))  # positions 0..9; the last (the tree's root) is fed with the tree
MAIN = [50, 51, 52]  # positions 10..12
ALT1 = [50, 60, 61]  # shares the root and 50 with MAIN
ALT2 = [50, 60, 70]  # shares the root, 50 and 60 with ALT1 (60 computed by ALT1's entry)
ALT3 = [80]  # shares only the root


def _steps(target, path):
    """The path's logits one decode step at a time, on a fresh cache: [len(path), vocab]."""
    cache = target.new_kv_cache(8, B)
    target.forward_batch(cache, [BatchEntry(PROMPT[:-1], 0, [0, 1, 2], 1)])
    tokens = [PROMPT[-1], *path]
    return torch.cat(
        [
            target.forward_batch(cache, [BatchEntry([t], len(PROMPT) - 1 + i, [0, 1, 2, 3], 1)])
            for i, t in enumerate(tokens)
        ]
    )


@pytest.mark.parametrize(
    "dtype,weights,float_kernel,kv",
    [
        (torch.float32, "float", "auto", "auto"),  # the one-call layer stack
        (torch.float32, "float", "auto", "float16"),
        (torch.float32, "q4_0", "auto", "auto"),
        (torch.float32, "int4", "auto", "auto"),  # fastdecode's glue kernels called one by one (torch's int4 GEMM)
        (torch.float32, "float", "torch", "auto"),  # torch's ops
        (torch.bfloat16, "float", "auto", "auto"),
    ],
)
def test_tree_rows_equal_decode_steps_bitwise(model, dtype, weights, float_kernel, kv):
    target = make_target(copy.deepcopy(model).to(dtype), "native", weights, float_kernel, kv_cache_dtype=kv)
    cache = target.new_kv_cache(16, B)
    target.forward_batch(cache, [BatchEntry(PROMPT[:-1], 0, [0, 1, 2], 1)])
    for private in ((4, 5), (6, 7), (8, 9)):  # each alternative path: its own copy of the partly filled block 2
        cache.copy_block(2, private[0])
    start = len(PROMPT) - 1
    entries = [
        BatchEntry([PROMPT[-1], *MAIN], start, [0, 1, 2, 3], 4),
        BatchEntry(ALT1[1:], start + 2, [0, 1, 4, 5], 2, shared=((0, 0), (0, 1))),
        BatchEntry(ALT2[2:], start + 3, [0, 1, 6, 7], 1, shared=((0, 0), (0, 1), (1, 0))),
        BatchEntry(ALT3, start + 1, [0, 1, 8, 9], 1, shared=((0, 0),)),
    ]
    logits = target.forward_batch(cache, entries)
    assert logits.shape[0] == 4 + 2 + 1 + 1  # each node once
    main, alt1, alt2, alt3 = logits[:4], logits[4:6], logits[6:7], logits[7:8]
    assert torch.equal(main, _steps(target, MAIN))
    assert torch.equal(torch.cat([main[:2], alt1]), _steps(target, ALT1))
    assert torch.equal(torch.cat([main[:2], alt1[:1], alt2]), _steps(target, ALT2))
    assert torch.equal(torch.cat([main[:1], alt3]), _steps(target, ALT3))
    # the shared nodes' keys and values were copied bit for bit into each path's blocks
    for layer in range(len(cache.k)):
        for pool in (cache.k[layer], cache.v[layer]):
            assert torch.equal(pool[4, :, 1:3], pool[2, :, 1:3])  # ALT1: the root and 50 (positions 9, 10)
            assert torch.equal(pool[6, :, 1:3], pool[2, :, 1:3])  # ALT2: as ALT1,
            assert torch.equal(pool[6, :, 3], pool[4, :, 3])  # + 60
            assert torch.equal(pool[8, :, 1], pool[2, :, 1])  # ALT3: the root


def test_shared_rows_must_be_earlier_rows_at_the_same_position(model):
    target = make_target(model, "native")
    cache = target.new_kv_cache(16, B)
    target.forward_batch(cache, [BatchEntry(PROMPT[:-1], 0, [0, 1, 2], 1)])
    main = BatchEntry([PROMPT[-1], *MAIN], 9, [0, 1, 2, 3], 4)
    for bad in (
        ((0, 1),),  # position 10's row shared into position 9
        ((1, 0),),  # the entry itself
        ((0, 9),),
    ):  # past the entry's rows
        with pytest.raises(ValueError, match="shared position"):
            target.forward_batch(cache, [main, BatchEntry([60], 10, [0, 1, 4, 5], 1, shared=bad)])
    with pytest.raises(ValueError, match="shared positions"):  # more shared positions than lie before start
        target.forward_batch(cache, [BatchEntry([60], 0, [4], 1, shared=((0, 0),))])
