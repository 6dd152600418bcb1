"""A verification pass gives every row the very bits a one-token decode step gives it."""

import copy

import pytest
import torch
from paged_helpers import assert_verify_equals_decode
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode.backends import PagedSequence, make_target


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, **dict(KERNEL_FRIENDLY, max_position_embeddings=256))


# (dtype, weights, float kernel): fastdecode's kernels (float32 "auto"), torch's
# chunked path (float32 "torch", and every other dtype), and the low-bit kernels.
@pytest.mark.parametrize(
    "dtype,weights,float_kernel",
    [
        (torch.float32, "float", "auto"),
        (torch.float32, "float", "torch"),
        (torch.bfloat16, "float", "auto"),
        (torch.float32, "int8", "auto"),
        (torch.float32, "int8", "torch"),
        (torch.float32, "int4", "auto"),
    ],
)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 13])
def test_verify_rows_equal_decode_steps_bitwise(model, dtype, weights, float_kernel, n):
    target = PagedSequence(make_target(copy.deepcopy(model).to(dtype), "native", weights, float_kernel))
    prompt = list(range(3, 40))
    target.forward(prompt, 1)
    drafts = list(range(50, 50 + n))
    verify = target.forward(drafts, n)
    assert target.cache_len == len(prompt) + n
    target.truncate(len(prompt))
    steps = torch.cat([target.forward([t], 1) for t in drafts])
    assert torch.equal(verify, steps)


def test_row_group_is_probed_from_the_model(model):
    rows_min, rows_max = make_target(model, "native").row_group
    assert 1 <= rows_min <= rows_max <= 16


def test_fastdecode_kernels_need_no_chunking(model):
    from fastdecode.kernels.cpu import rowgemm_unavailable

    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    target = make_target(model, "native", "float", "auto")
    assert target.float_kernel == "rowgemm" and target.cpu_kernels
    assert target.row_group == (1, target.ROWS_PROBED)  # decode steps of one row, verification in one pass


# A float16 KV cache: on fastdecode's kernels (float32, int8 and block weights) and on torch's path.
@pytest.mark.parametrize(
    "weights,float_kernel", [("float", "auto"), ("float", "torch"), ("int8", "auto"), ("q4_0", "auto")]
)
@pytest.mark.parametrize("n", [3, 8])
def test_float16_kv_cache_verify_rows_equal_decode_steps_bitwise(model, weights, float_kernel, n):
    executor = make_target(model, "native", weights, float_kernel, kv_cache_dtype="float16")
    assert executor.kv_cache_dtype == "float16"
    assert_verify_equals_decode(executor, n)


def test_float16_kv_cache_halves_the_cache_and_changes_the_numerics(model):
    f32 = make_target(model, "native")
    f16 = make_target(model, "native", kv_cache_dtype="float16")
    assert f16.kv_block_bytes(16) * 2 == f32.kv_block_bytes(16)
    assert f16.new_kv_cache(2).k[0].dtype == torch.float16
    prompt = list(range(3, 60))
    a, b = PagedSequence(f32).forward(prompt, 4), PagedSequence(f16).forward(prompt, 4)
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=0, atol=5e-2)  # a rounding of K and V, not another model


def test_kv_cache_dtype_errors(model):
    from fastdecode.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        make_target(model, "native", kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="float32 or float16"):
        make_target(model, "native", kv_cache_dtype="bfloat16")  # on fastdecode's CPU kernels
    with pytest.raises(ConfigError, match="native backend"):
        make_target(model, "hf", kv_cache_dtype="float16")
    torch_path = make_target(model, "native", float_kernel="torch", kv_cache_dtype="bfloat16")  # torch's ops take any
    assert torch_path.new_kv_cache(1).k[0].dtype == torch.bfloat16
