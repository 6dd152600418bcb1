"""Gemma 3 on the native decoder: the same logits as transformers, every verification
row a decode step's bits, and lossless drafting - on a tiny random-weight model."""

import pytest
import torch
from tiny_models import tiny_gemma3

from fastdecode import Engine, build_drafter
from fastdecode.backends import HFTarget, PagedSequence, make_target, native_support
from fastdecode.kernels.cpu import rowgemm_unavailable

FLOAT_KERNELS = ["auto", "torch"]  # fastdecode's kernels (per-kernel layers) and torch ops


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3()


def test_auto_picks_native_for_gemma3(model):
    assert native_support(model) is None
    target = make_target(model)
    assert target.name == "native"
    assert target.arch.windows == (5, None, 5) and target.arch.norm_offset == 1.0
    if rowgemm_unavailable() is None:
        assert target.cpu_kernels and target._layer_calls is not None  # decode and verify: one kernel call a layer


@pytest.mark.parametrize("float_kernel", FLOAT_KERNELS)
def test_logits_match_transformers_across_the_sliding_window(model, float_kernel):
    native, hf = PagedSequence(make_target(model, "native", "float", float_kernel)), HFTarget(model)
    prompt = list(range(1, 12))  # longer than the window of 5
    torch.testing.assert_close(native.forward(prompt, 11), hf.forward(prompt, 11))
    torch.testing.assert_close(native.forward([5, 6, 7], 3), hf.forward([5, 6, 7], 3))  # a verification pass
    for t in range(8):
        torch.testing.assert_close(native.forward([t + 3], 1), hf.forward([t + 3], 1))
    native.truncate(16)
    hf.truncate(16)
    torch.testing.assert_close(native.forward([40, 41], 2), hf.forward([40, 41], 2))  # after a rollback


def test_bf16_logits_close_to_transformers():
    model = tiny_gemma3(dtype=torch.bfloat16)
    native, hf = PagedSequence(make_target(model, "native")), HFTarget(model)
    torch.testing.assert_close(
        native.forward(list(range(1, 12)), 11), hf.forward(list(range(1, 12)), 11), atol=3e-2, rtol=3e-2
    )
    torch.testing.assert_close(native.forward([7], 1), hf.forward([7], 1), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("float_kernel,weights", [("auto", "float"), ("torch", "float"), ("auto", "int8")])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_verify_rows_equal_decode_steps_bitwise(model, float_kernel, weights, n):
    target = PagedSequence(make_target(model, "native", weights, float_kernel))
    prompt = list(range(3, 20))
    target.forward(prompt, 1)
    drafts = list(range(50, 50 + n))
    verify = target.forward(drafts, n)
    target.truncate(len(prompt))
    steps = torch.cat([target.forward([t], 1) for t in drafts])
    assert torch.equal(verify, steps)


@pytest.mark.parametrize("drafter", [None, "ngram"])
@pytest.mark.parametrize("float_kernel", FLOAT_KERNELS)
def test_greedy_output_identical_to_transformers(model, tokenizer, drafter, float_kernel):
    prompt = [1] + [10, 11, 12, 13, 14] * 4
    ref = Engine(model, tokenizer, target=HFTarget(model)).generate(prompt, max_new_tokens=30)
    engine = Engine(
        model,
        tokenizer,
        drafter=build_drafter(drafter) if drafter else None,
        target=make_target(model, "native", "float", float_kernel),
    )
    assert engine.generate(prompt, max_new_tokens=30).token_ids == ref.token_ids


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_position_dependent_rope_stays_on_transformers(rope_type):
    """These rescale RoPE by the longest position of a call; the native decoder's
    one table per cache would differ from transformers, so it refuses them."""
    from tiny_models import tiny_llama

    def extra(head_dim):  # longrope's factors: one per rotary frequency
        if rope_type == "dynamic":
            return {"factor": 2.0}
        return {
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [2.0] * (head_dim // 2),
        }

    gemma = tiny_gemma3(
        rope_parameters={
            "full_attention": {"rope_type": rope_type, "rope_theta": 1e6, **extra(16)},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    assert rope_type in native_support(gemma)
    assert make_target(gemma).name == "hf"
    llama = tiny_llama(rope_scaling={"rope_type": rope_type, "rope_theta": 1e4, **extra(8)})
    assert rope_type in native_support(llama)


def test_static_rope_scaling_runs_natively():
    gemma = tiny_gemma3(
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    )
    native, hf = PagedSequence(make_target(gemma, "native")), HFTarget(gemma)
    torch.testing.assert_close(native.forward(list(range(1, 12)), 11), hf.forward(list(range(1, 12)), 11))


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_one_call_layers_give_the_per_kernel_bits(model, weights):
    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    fused, per_call = (
        PagedSequence(make_target(model, "native", weights)),
        PagedSequence(make_target(model, "native", weights)),
    )
    assert fused.executor._layer_calls is not None
    per_call.executor._layer_calls = None  # the same kernels, called one by one from Python
    for target in (fused, per_call):
        target.forward(list(range(3, 20)), 1)  # past the window of 5
    for tokens in ([40], [41, 42, 43, 44, 45], [46]):  # a decode step, a verification pass, a step
        assert torch.equal(fused.forward(tokens, len(tokens)), per_call.forward(tokens, len(tokens)))
    assert fused.cache_len == per_call.cache_len
    for cache_a, cache_b in zip(fused._cache.k + fused._cache.v, per_call._cache.k + per_call._cache.v):
        assert torch.equal(written_kv(fused, cache_a), written_kv(per_call, cache_b))


def written_kv(sequence, pool):
    """The K or V rows of the positions a sequence's private cache has written,
    [cache_len, KV, D] (the pool [num_blocks, KV, block_size, D] is allocated uninitialized)."""
    B = pool.shape[2]
    t = torch.arange(sequence.cache_len)
    return pool[torch.tensor(sequence._table)[t // B], :, t % B]
