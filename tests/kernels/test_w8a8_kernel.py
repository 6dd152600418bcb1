"""The W8A8 kernel (kernels/w8a8.c, kernels/w8a8.py): int8 per-channel weights x int8 per-token
activations equal the torch reference bit for bit at every row count, on every implementation this
CPU runs, and every row gets the bits it gets alone."""

import ctypes
from pathlib import Path

import pytest
import torch
from block_checks import ALL_IMPLS, assert_projection_rows_invariant

from fastdecode.errors import ConfigError
from fastdecode.kernels import abi, build
from fastdecode.kernels.gguf_blocks import BlockTensor
from fastdecode.kernels.quant import Projection, block_linear_reference, kernel_unavailable, pack, supported_impls
from fastdecode.kernels.w8a8 import (
    MAX_INPUTS,
    pack_w8a8,
    quantize_tokens,
    quantize_tokens_reference,
    w8a8_bytes,
    w8a8_linear_reference,
)

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=str(kernel_unavailable()))
ROWS = (*range(1, 17), 70)  # every tile height (1-8 rows), with and without a second tile


def _weights(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (rows, cols), generator=gen).to(torch.int8)  # -128 too: a checkpoint may hold it
    q[0] = 127  # a row at the extreme
    return q, torch.rand(rows, generator=gen) * 0.02


def _acts(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 4
    x[3] = 0.0  # a row of zeros: scale 0
    x[5, 7] = 300.0  # an outlier: the rest of its row rounds coarsely
    if rows > 8:
        x[6] *= 1e-38  # a scale whose inverse is no finite float: q = 0, never NaN (AVX2 packed that as -128)
        x[8, 2] = float("nan")  # q = -127 there, the rest of the row as if it were not there
    return x


@needs_kernel
@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("rows, cols", [(24, 64), (13, 96), (8, 36), (40, 576), (17, 1536)])
def test_the_kernel_is_the_reference_bit_for_bit_at_every_row_count(impl, rows, cols):
    q, scales = _weights(rows, cols)
    bias = torch.randn(rows)
    proj = Projection([pack_w8a8(q, scales)], bias, cols, impl=impl)
    x = _acts(max(ROWS), cols)
    reference = w8a8_linear_reference(x, q, scales, bias)
    whole = proj(x)
    assert torch.equal(whole, reference)
    for m in ROWS:
        assert torch.equal(proj(x[:m]), reference[:m]), m
        assert torch.equal(proj(x[m - 1 : m]), whole[m - 1 : m]), m  # a row alone: the bits it gets among 70


@needs_kernel
@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_the_activations_are_quantized_per_token_as_the_reference_does(impl):
    x = _acts(9, 100)
    q, d, s = quantize_tokens(x, impl)
    q_ref, d_ref = quantize_tokens_reference(x)
    assert torch.equal(q[:, :100], q_ref) and not q[:, 100:].any()  # zeros past K, to a multiple of 32
    assert torch.equal(d, d_ref) and float(d[3]) == 0.0
    assert torch.equal(s, q_ref.sum(-1, dtype=torch.int32))
    assert int(q_ref.abs().max()) == 127 and int(q_ref.min()) >= -127  # never -128: the AVX2 sign trick needs it


@needs_kernel
@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_rows_are_invariant_on_one_and_two_threads(impl):
    q, scales = _weights(40, 576, seed=3)
    x = _acts(16, 576)
    full = assert_projection_rows_invariant(Projection([pack_w8a8(q, scales)], None, 576, impl=impl), x)
    assert torch.equal(full, w8a8_linear_reference(x, q, scales))


@needs_kernel
def test_a_fused_projection_mixes_w8a8_and_block_parts():
    q, scales = _weights(16, 64, seed=2)
    k = BlockTensor.quantize(torch.randn(8, 64), "q8_0")
    x = _acts(6, 64)
    fused = Projection([pack_w8a8(q, scales), pack(k)], None, 64)
    expected = torch.cat([w8a8_linear_reference(x, q, scales), block_linear_reference(x, [k])], dim=-1)
    assert torch.equal(fused(x), expected)
    assert fused.scratch_bytes(6) > Projection([pack(k)], None, 64).scratch_bytes(6)  # both activation forms


def test_the_layout_is_32_bytes_a_32_weights():
    q, scales = _weights(13, 96)
    packed = pack_w8a8(q, scales)
    assert packed.format == "w8a8" and packed.data.numel() == w8a8_bytes(13, 96) == 2 * (32 + 8 * 96)
    with pytest.raises(ValueError, match="int8"):
        pack_w8a8(q.float(), scales)


def test_inputs_beyond_exact_int32_sums_are_refused():
    assert MAX_INPUTS == 132_104  # 2^31 / (128 * 127): |isum| and 128 * sx stay below 2^31
    pack_w8a8(torch.zeros(1, MAX_INPUTS // 32 * 32, dtype=torch.int8), torch.ones(1))
    with pytest.raises(ConfigError, match="at most"):
        pack_w8a8(torch.zeros(1, MAX_INPUTS + 1, dtype=torch.int8), torch.ones(1))


def test_the_format_code_is_declared_once_in_the_c_source():
    source = (Path(abi.__file__).with_name("quant.c")).read_text()
    assert f"#define FD_W_W8A8 {abi.WEIGHT_FORMATS['w8a8']}" in source
    assert '#include "w8a8.c"' in (Path(abi.__file__).with_name("cpu.c")).read_text()


@pytest.fixture(scope="module")
def evex_vnni_library():
    """The library built with FD_AVX_VNNI_AS_EVEX: w8a8.c's AVX-VNNI loop with vpdpbusd in its
    AVX-512 VL encoding (the same operation), run where the CPU has AVX-512 VNNI but not AVX-VNNI
    (built once, then cached beside the library itself)."""
    impls = supported_impls()
    if "avx_vnni" in impls or "avx512_vnni" not in impls:
        pytest.skip("the AVX-VNNI loop runs as itself here (test_the_kernel_is_the_reference...), or cannot run")
    return abi.bind(ctypes.CDLL(str(build.build(build.find_compiler(), extra=("-DFD_AVX_VNNI_AS_EVEX",)))))


@needs_kernel
def test_the_avx_vnni_loop_is_the_reference_bit_for_bit(evex_vnni_library):
    # the test build changes w8a8.c alone: the block formats' VEX AVX-VNNI loops would fault here
    assert not evex_vnni_library.fd_impl_supported(abi.IMPLS["avx_vnni"])
    for rows, cols in [(24, 64), (13, 96), (17, 1536)]:
        q, scales = _weights(rows, cols)
        bias = torch.randn(rows)
        x = _acts(max(ROWS), cols)
        reference = w8a8_linear_reference(x, q, scales, bias)
        proj = Projection([pack_w8a8(q, scales)], bias, cols, impl="avx512_vnni")  # every pass on the ymm loop
        for m in ROWS:
            y = torch.empty(m, rows)
            evex_vnni_library.fd_project(x.data_ptr(), m, cols, proj.ref, None, y.data_ptr())
            assert torch.equal(y, reference[:m]), (rows, cols, m)
