"""The native target over a quantized KV cache (--kv-cache-dtype q8_0 | q4_0 | q8_0/q4_0):
verification rows keep a decode step's bits, the budget counts the real bytes, and the
transformers target and heads of other widths are refused clearly."""

import copy

import pytest
import torch
from paged_helpers import assert_verify_equals_decode
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode import Engine
from fastdecode.backends import PagedSequence, make_target
from fastdecode.errors import ConfigError

QUANTIZED = ["q8_0", "q4_0", "q8_0/q4_0"]


@pytest.fixture(scope="module")
def model():
    # head_dim 32: one block of 32 values a row (KERNEL_FRIENDLY's heads of 16 cannot be quantized)
    return tiny_llama(3, **dict(KERNEL_FRIENDLY, num_attention_heads=2, num_key_value_heads=1))


# fastdecode's kernels (float32, int8 and block weights: the fused layer stack), the per-layer
# kernel path (int4 on torch's packed kernels) and torch's ops (the portable path, any CPU)
@pytest.mark.parametrize(
    "weights,float_kernel",
    [("float", "auto"), ("int8", "auto"), ("q4_0", "auto"), ("int4", "auto"), ("float", "torch")],
)
@pytest.mark.parametrize("kv", QUANTIZED)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_quantized_kv_cache_verify_rows_equal_decode_steps_bitwise(model, weights, float_kernel, kv, n):
    executor = make_target(model, "native", weights, float_kernel, kv_cache_dtype=kv)
    assert executor.kv_cache_dtype == kv
    assert_verify_equals_decode(executor, n)


def test_the_budget_counts_the_real_bytes(model):
    f32 = make_target(model, "native")
    # a row of 32 values: 128 bytes in float32, 64 in float16, 34 in q8_0 (32 int8 + an fp16 scale), 18 in q4_0
    for kv, row_bytes in [("float16", 64), ("q8_0", 34), ("q4_0", 18), ("q8_0/q4_0", 26)]:
        target = make_target(model, "native", kv_cache_dtype=kv)
        assert target.kv_block_bytes(16) * 128 == f32.kv_block_bytes(16) * row_bytes, kv
        cache = target.new_kv_cache(3)
        assert sum(t.numel() * t.element_size() for t in cache.k + cache.v) == 3 * target.kv_block_bytes(16)


def test_a_quantized_cache_changes_the_numerics_a_little(model):
    prompt = list(range(3, 60))
    f32 = PagedSequence(make_target(model, "native")).forward(prompt, 4)
    for kv, atol in [("q8_0", 5e-2), ("q4_0", 3e-1)]:
        q = PagedSequence(make_target(model, "native", kv_cache_dtype=kv)).forward(prompt, 4)
        assert not torch.equal(q, f32)
        torch.testing.assert_close(q, f32, rtol=0, atol=atol)  # a rounding of K and V, not another model


def test_the_torch_path_holds_the_kernels_bytes(model):
    """The portable path (torch's ops) writes what cpu.c writes: the same quantized rows."""
    prompt = list(range(3, 40))
    caches = []
    for float_kernel in ("auto", "torch"):
        seq = PagedSequence(make_target(model, "native", float_kernel=float_kernel, kv_cache_dtype="q8_0"))
        seq.forward(prompt, 1)
        caches.append(seq._cache.k[0][0, :, :8])  # layer 0's first 8 keys: the embeddings' rows, before any GEMM
    assert caches[0].dtype == torch.uint8 and caches[0].shape[-1] == 34
    assert (caches[0].int() - caches[1].int()).abs().max() <= 1  # the rotation's float32 rounding may differ


def test_quantized_cache_errors(model):
    with pytest.raises(ConfigError, match="native backend"):
        make_target(model, "hf", kv_cache_dtype="q8_0")
    with pytest.raises(ConfigError, match="multiple of 32"):
        make_target(tiny_llama(0), "native", kv_cache_dtype="q4_0")  # head_dim 8
    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        make_target(model, "native", kv_cache_dtype="q5_0")
    bf16 = make_target(copy.deepcopy(model).to(torch.bfloat16), "native", kv_cache_dtype="q8_0")  # torch's path
    assert_verify_equals_decode(bf16, 3)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_gemma3_sliding_window_layers_over_a_quantized_cache(kv):
    """Gemma 3's local layers (a 5-position window) and its global one, over quantized rows."""
    from tiny_models import tiny_gemma3

    assert_verify_equals_decode(make_target(tiny_gemma3(1, head_dim=32), "native", kv_cache_dtype=kv), 8)


# ---------------------------------------------------------------- KV policies over a quantized cache

POLICY_CONTEXT = 64  # a small window, so generations cross it
POLICY_PROMPT = [1] + [20, 21, 22, 23] * 5


@pytest.fixture(scope="module")
def policy_model():
    # head_dim 32 (two heads over one KV head) in the tokenizer fixture's vocabulary
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    return tiny_llama(4, **shape, max_position_embeddings=POLICY_CONTEXT, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("kv,policy", [("q8_0", "sinks"), ("q4_0", "h2o:0.5"), ("q8_0/q4_0", "sinks:4,24")])
def test_a_policy_over_a_quantized_cache_goes_past_the_window_and_speculates_losslessly(
    policy_model, tokenizer, oracle_drafter, kv, policy
):
    """Moved keys are widened, re-rotated and quantized again (NativeTarget.move_kv): the moves are
    decided from accepted tokens only, so speculation meets the very rows plain decoding does."""
    target = make_target(policy_model, "native", kv_cache_dtype=kv)
    reference = Engine(policy_model, tokenizer, target=target).generate(
        POLICY_PROMPT, max_new_tokens=110, kv_policy=policy
    )
    assert reference.finish_reason == "length" and len(POLICY_PROMPT) + len(reference.token_ids) > POLICY_CONTEXT
    drafter = oracle_drafter(POLICY_PROMPT + reference.token_ids, corrupt=lambda step, i: (step + i) % 5 == 4)
    engine = Engine(policy_model, tokenizer, target=target, drafter=drafter)
    out = engine.generate(POLICY_PROMPT, max_new_tokens=110, kv_policy=policy, draft_k=6)
    assert out.token_ids == reference.token_ids and out.acceptance.accepted_tokens > 0


def test_a_moved_quantized_key_is_the_key_written_at_its_new_slot_requantized(policy_model):
    from fastdecode.backends.base import BatchEntry
    from fastdecode.kernels.kv_formats import FORMATS
    from fastdecode.kv.cache import BlockTable
    from fastdecode.kv.policy import compact

    target = make_target(policy_model, "native", kv_cache_dtype="q8_0")
    tokens = [5, 9, 13, 40, 41, 42, 7]
    moved, direct = target.new_kv_cache(4, 4), target.new_kv_cache(4, 4)
    table = BlockTable(moved.pool.allocate(3))
    target.forward_batch(moved, [BatchEntry([3, 3, 3, *tokens], 0, table.blocks, 1)])  # tokens at slots 3..9
    target.forward_batch(direct, [BatchEntry(tokens, 0, [0, 1], 1)])  # at slots 0..6
    compact(target, moved, table, keep=list(range(3, 10)))  # slots 3..9 -> 0..6
    fmt = FORMATS["q8_0"]
    got = fmt.load(moved.k[0][table.blocks]).transpose(1, 2).reshape(-1, 32)[:7]  # layer 0, one KV head
    want = fmt.load(direct.k[0][[0, 1]]).transpose(1, 2).reshape(-1, 32)[:7]
    step = want.abs().amax(-1, keepdim=True) / 127  # a q8_0 step, rounded twice
    assert (got - want).abs().le(2 * step + 1e-6).all() and not torch.equal(got, torch.zeros_like(got))
