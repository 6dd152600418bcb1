"""The row-invariant CPU kernels (GEMM and attention): right answers, and each row's bits independent of the others."""

import pytest
import torch
import torch.nn.functional as F

from fastdecode.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.rowgemm_unavailable() is not None, reason=str(cpu.rowgemm_unavailable()))

# (out_features, in_features): multiples of the kernel's blocks, and awkward sizes
# that exercise the N % 8 leftover outputs and the K % 8 tail; the long ones make
# multi-row blocks reduce K in chunks (x too long for L1: K > 768 at 8 rows,
# > 3072 at 2), with a tail chunk and a K % 8 tail.
SHAPES = [(64, 32), (96, 64), (13, 8), (21, 37), (1, 5), (8, 1), (17, 1037), (9, 3203)]


def _sum_tol(k: int) -> float:
    """Absolute tolerance for float32 sums of k unit-variance products: rounding
    error grows like sqrt(k) (sums of randn products are ~sqrt(k) in size)."""
    return 1e-5 + 2e-6 * k**0.5


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_f_linear(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(11, k, generator=gen)
    tol = _sum_tol(k)
    torch.testing.assert_close(cpu.rowgemm(x, w), F.linear(x, w), rtol=1e-5, atol=tol)
    torch.testing.assert_close(cpu.rowgemm(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=tol)


def test_matches_float64_reference_closely():
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(40, 300, generator=gen), torch.randn(3, 300, generator=gen)
    exact = (x.double() @ w.double().T).float()
    # One rounding per fused multiply-add over 300 terms: far inside float32 noise.
    assert (cpu.rowgemm(x, w) - exact).abs().max() < 1e-4


@pytest.mark.parametrize("n,k", SHAPES)
def test_each_row_is_bitwise_independent_of_the_row_count(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(16, k, generator=gen)
    full = cpu.rowgemm(x, w)
    for m in range(1, 17):
        assert torch.equal(cpu.rowgemm(x[:m], w), full[:m]), m
        assert torch.equal(cpu.rowgemm(x[m - 1 : m], w), full[m - 1 : m]), m


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("int8", [False, True])
def test_prefill_sized_passes_keep_each_rows_bits(n, k, int8):
    """From 48 rows on, float32 rows go three at a time against four weight rows (cpu.c's
    tile_f32_3x4): each row's bits must still be the one-row pass's, rows left over included.
    (int8 keeps its 8-row blocks at every size: its rows must be invariant there too.)"""
    gen = torch.Generator().manual_seed(40 + n + k)
    if int8:
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = torch.rand(n, generator=gen)
        gemm = lambda x: cpu.rowgemm_i8(x, q, scales)  # noqa: E731
    else:
        w = torch.randn(n, k, generator=gen)
        gemm = lambda x: cpu.rowgemm(x, w)  # noqa: E731
    x = torch.randn(101, k, generator=gen)
    rows = torch.cat([gemm(x[i : i + 1]) for i in range(101)])
    for m in (47, 48, 49, 50, 101):
        assert torch.equal(gemm(x[:m]), rows[:m]), m


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 7])
def test_many_row_attention_on_two_threads_gives_each_row_its_one_row_bits(kv_dtype, window):
    """The many-query path splits its work items between threads by attended positions and
    gives each thread its own scratch for the scores (cpu.c, fd_attention_f32): with two
    threads (the suite runs on one), every row must still get a one-row pass's bits."""
    gen = torch.Generator().manual_seed(11)
    n, H, KV, D = 37, 4, 2, 16
    q = torch.randn(n, H, D, generator=gen)
    k = torch.randn(KV, 64, D, generator=gen).to(kv_dtype)
    v = torch.randn(KV, 64, D, generator=gen).to(kv_dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rows = cpu.attention_rows(q, k, v, 0, 0.25, window)  # n H = 148: the many-query path
        one = torch.cat([cpu.attention_rows(q[i : i + 1], k, v, i, 0.25, window) for i in range(n)])
        torch.set_num_threads(1)
        single = cpu.attention_rows(q, k, v, 0, 0.25, window)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(rows, one) and torch.equal(rows, single)


def test_row_bits_do_not_depend_on_thread_count():
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(200, 64, generator=gen), torch.randn(5, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.rowgemm(x, w)
        torch.set_num_threads(2)
        two = cpu.rowgemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_leading_dims_and_non_contiguous_input():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 16, generator=gen)
    x = torch.randn(2, 3, 32, generator=gen)[..., ::2]  # [2, 3, 16], strided
    torch.testing.assert_close(cpu.rowgemm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert cpu.rowgemm(x[:0].reshape(0, 16), w).shape == (0, 24)


def test_refuses_what_it_cannot_compute():
    w = torch.randn(8, 8)
    with pytest.raises(TypeError, match="float32"):
        cpu.rowgemm(torch.randn(2, 8, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="features"):
        cpu.rowgemm(torch.randn(2, 9), w)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.rowgemm(torch.randn(2, 8), torch.randn(8, 16)[:, ::2])


def test_no_compiler_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu._load.cache_clear()
    try:
        assert "no C compiler" in cpu.rowgemm_unavailable()
        with pytest.raises(RuntimeError, match="no C compiler"):
            cpu.rowgemm(torch.randn(1, 8), torch.randn(8, 8))
    finally:
        monkeypatch.undo()
        cpu._load.cache_clear()
    assert cpu.rowgemm_unavailable() is None


def test_the_split_modules_run_through_cpus_loader(monkeypatch):
    """ops and layer call the library cpu.py loads (its _compiler and _load are the seams),
    and cpu re-exports them as they are."""
    from fastdecode.kernels import layer, ops

    assert cpu.rowgemm is ops.rowgemm and cpu.DecoderLayerKernel is layer.DecoderLayerKernel
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu._load.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no C compiler"):
            ops.rms_norm(torch.ones(1, 8), torch.ones(8), 1e-6)
        with pytest.raises(RuntimeError, match="no C compiler"):
            layer.Projection([(torch.ones(8, 8), None)], None, 8)(torch.ones(1, 8))
    finally:
        monkeypatch.undo()
        cpu._load.cache_clear()
    assert ops.rms_norm(torch.ones(1, 8), torch.ones(8), 1e-6).shape == (1, 8)


def test_a_failed_build_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    bad = tmp_path / "cpu.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu, "SOURCE", bad)
    cpu._load.cache_clear()
    try:
        assert "could not be built" in cpu.rowgemm_unavailable()
    finally:
        cpu._load.cache_clear()


def test_shares_torchs_openmp_runtime():
    cpu.rowgemm(torch.randn(1, 8), torch.randn(8, 8))
    with open("/proc/self/maps") as fh:
        maps = fh.read()
    gomp = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    assert len(gomp) == 1, gomp  # one runtime, one thread pool


def _cache(n_kv, capacity, d, filled, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.zeros(n_kv, capacity, d)
    v = torch.zeros(n_kv, capacity, d)
    k[:, :filled] = torch.randn(n_kv, filled, d, generator=gen)
    v[:, :filled] = torch.randn(n_kv, filled, d, generator=gen)
    return k, v


@pytest.mark.parametrize("n_heads,n_kv,d", [(4, 4, 8), (9, 3, 64), (6, 2, 16), (8, 1, 24)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 5), (37, 1), (37, 8)])
def test_attention_matches_causal_sdpa(n_heads, n_kv, d, start, n):
    k, v = _cache(n_kv, 64, d, start + n, seed=start + n)
    q = torch.randn(n, n_heads, d, generator=torch.Generator().manual_seed(1))
    scale = d**-0.5
    out = cpu.attention_rows(q, k, v, start, scale)
    end = start + n
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)  # query i sees keys 0 .. start + i
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None, :, :end],
        v[None, :, :end],
        attn_mask=mask,
        scale=scale,
        enable_gqa=n_heads != n_kv,
    )
    torch.testing.assert_close(out, ref[0].transpose(0, 1).reshape(n, n_heads * d), rtol=1e-5, atol=1e-5)


# Query blocking: 3 heads a group (blocks mixing rows), 8 (a group split across
# blocks), 1 (blocks of rows only); D = 24 leaves an 8-lane tail after 16-lane chunks.
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (8, 1, 24), (4, 4, 16)])
def test_attention_rows_are_bitwise_independent_of_the_row_count(n_heads, n_kv, d):
    start, n_max = 20, 12
    k, v = _cache(n_kv, 64, d, start + n_max, seed=5)
    q = torch.randn(n_max, n_heads, d, generator=torch.Generator().manual_seed(6))
    full = cpu.attention_rows(q, k, v, start, 0.125)
    for first in range(n_max):
        for n in range(1, n_max - first + 1):
            # rows first .. first + n - 1 alone, at their own positions
            part = cpu.attention_rows(q[first : first + n], k, v, start + first, 0.125)
            assert torch.equal(part, full[first : first + n]), (first, n)


def test_attention_takes_strided_queries():
    k, v = _cache(2, 32, 16, 10, seed=8)
    q_heads_first = torch.randn(4, 3, 16)  # [H, n, D], as the native decoder holds q after RoPE
    q = q_heads_first.transpose(0, 1)  # [n, H, D] with head stride 3 * 16
    torch.testing.assert_close(
        cpu.attention_rows(q, k, v, 7, 0.25), cpu.attention_rows(q.contiguous(), k, v, 7, 0.25), rtol=0, atol=0
    )


def test_attention_refuses_what_it_cannot_compute():
    k, v = _cache(2, 16, 12, 4, seed=9)
    with pytest.raises(ValueError, match="head_dim"):
        cpu.attention_rows(torch.randn(1, 4, 12), k, v, 3, 1.0)
    k, v = _cache(2, 16, 8, 4, seed=9)
    with pytest.raises(ValueError, match="capacity"):
        cpu.attention_rows(torch.randn(4, 4, 8), k, v, 14, 1.0)
    with pytest.raises(TypeError, match="float32"):
        cpu.attention_rows(torch.randn(1, 4, 8).bfloat16(), k, v, 3, 1.0)


def test_rms_norm_matches_transformers_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(10)
    x = torch.randn(5, 37, generator=gen) * 3  # 37: the vector loop and its tail
    norm = LlamaRMSNorm(37, eps=1e-5)
    norm.weight.data = torch.randn(37, generator=gen)
    torch.testing.assert_close(cpu.rms_norm(x, norm.weight.data, 1e-5), norm(x).detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu.rms_norm(x[2:3], norm.weight.data, 1e-5), cpu.rms_norm(x, norm.weight.data, 1e-5)[2:3])


def test_rope_qkv_matches_transformers_and_fills_the_cache():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    H, KV, D, n, start, cap = 6, 2, 16, 3, 5, 12
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(n, (H + 2 * KV) * D, generator=gen)
    angles = torch.randn(n, D // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [n, D]
    k_cache, v_cache = torch.zeros(KV, cap, D), torch.zeros(KV, cap, D)
    q = cpu.rope_qkv(qkv, H, KV, D, cos, sin, k_cache, v_cache, start)

    q_ref = qkv[:, : H * D].view(n, H, D).transpose(0, 1)[None]  # [1, H, n, D]
    k_ref = qkv[:, H * D : (H + KV) * D].view(n, KV, D).transpose(0, 1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q_ref, k_ref, cos[None], sin[None])
    torch.testing.assert_close(q, q_ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache[:, start : start + n], k_ref[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache[:, start : start + n], qkv[:, (H + KV) * D :].view(n, KV, D).transpose(0, 1))
    assert not k_cache[:, :start].any() and not k_cache[:, start + n :].any()  # nothing else written
    with pytest.raises(ValueError, match="capacity"):
        cpu.rope_qkv(qkv, H, KV, D, cos, sin, k_cache, v_cache, cap - 1)


def test_silu_glu_is_swiglu():
    gate_up = torch.randn(4, 2 * 19, generator=torch.Generator().manual_seed(12)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.glu(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_glue_kernels_refuse_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        cpu.glu(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="contiguous"):
        cpu.rms_norm(torch.randn(8, 4).T, torch.ones(8), 1e-6)


def test_bad_shapes_are_refused_before_reaching_c():
    cs = torch.ones(1, 8)
    qkv = torch.ones(1, 24)  # H = KV = 1, D = 8
    k, v = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    for args, pattern in [
        ((qkv, 1, 1, 8, cs, cs, k, v, -2), "start"),
        ((qkv, 1, 1, 8, cs, cs, k, torch.zeros(1, 1, 8), 0), "caches"),
        ((qkv, 1, 1, 8, cs, cs, torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), 0), "caches"),
        ((qkv, 1, 1, 8, cs, cs, torch.zeros(1, 4, 16), torch.zeros(1, 4, 16), 0), "caches"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            cpu.rope_qkv(*args)
    q = torch.ones(1, 1, 8)
    with pytest.raises(ValueError, match="caches"):
        cpu.attention_rows(q, torch.zeros(1, 4, 16), torch.zeros(1, 4, 16), 0, 1.0)
    with pytest.raises(ValueError, match="caches"):
        cpu.attention_rows(q, torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), 2, 1.0)
    with pytest.raises(ValueError, match="start"):
        cpu.attention_rows(q, k, v, -1, 1.0)
    with pytest.raises(ValueError, match="weight"):
        cpu.rms_norm(torch.ones(2, 8), torch.arange(16.0)[:4], 1e-6)
    with pytest.raises(ValueError, match="2 \\* inter"):
        cpu.glu(torch.ones(2, 5))


def test_nan_propagates_like_sdpa():
    k, v = _cache(1, 8, 8, 4, seed=13)
    k[0, 2, 0] = float("nan")
    out = cpu.attention_rows(torch.randn(1, 1, 8), k, v, 3, 1.0)
    assert out.isnan().all()
    assert cpu.glu(torch.tensor([[float("nan"), 1.0]])).isnan().all()


def test_empty_reduction_gives_zeros_like_f_linear():
    x, w, b = torch.randn(3, 0), torch.randn(5, 0), torch.randn(5)
    torch.testing.assert_close(cpu.rowgemm(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_gemm_matches_its_dequantized_weight(n, k):
    from fastdecode.quant.math import dequantize_int8_per_channel, quantize_int8_per_channel

    gen = torch.Generator().manual_seed(20 + n + k)
    q, scales = quantize_int8_per_channel(torch.randn(n, k, generator=gen))
    x, b = torch.randn(7, k, generator=gen), torch.randn(n, generator=gen)
    ref = F.linear(x.double(), dequantize_int8_per_channel(q, scales).double(), b.double()).float()
    torch.testing.assert_close(cpu.rowgemm_i8(x, q, scales.float(), b), ref, rtol=1e-5, atol=_sum_tol(k))


@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_rows_are_bitwise_independent_of_the_row_count(n, k):
    gen = torch.Generator().manual_seed(30 + n + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales, x = torch.rand(n, generator=gen), torch.randn(16, k, generator=gen)
    full = cpu.rowgemm_i8(x, q, scales)
    for m in range(1, 17):
        assert torch.equal(cpu.rowgemm_i8(x[:m], q, scales), full[:m]), m
        assert torch.equal(cpu.rowgemm_i8(x[m - 1 : m], q, scales), full[m - 1 : m]), m


def test_int8_gemm_refuses_bad_weights():
    x = torch.randn(2, 8)
    with pytest.raises(TypeError, match="int8"):
        cpu.rowgemm_i8(x, torch.randn(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        cpu.rowgemm_i8(x, torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))
    with pytest.raises(TypeError, match="contiguous int8"):
        cpu.rowgemm_i8(x, torch.zeros(8, 4, dtype=torch.int8).T, torch.ones(4))


def test_gelu_tanh_glu_is_gemmas_geglu():
    gate_up = torch.randn(3, 2 * 37, generator=torch.Generator().manual_seed(40)) * 4  # an odd width: the tail too
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        cpu.glu(gate_up, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="unknown activation"):
        cpu.glu(gate_up, "relu")


def test_head_rms_norm_normalizes_each_head_in_place():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    n, H, KV, D = 3, 4, 2, 16
    qkv = torch.randn(n, (H + 2 * KV) * D, generator=torch.Generator().manual_seed(41))
    norm = Gemma3RMSNorm(D, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.3)
    expected = qkv.clone().view(n, H + 2 * KV, D)
    with torch.no_grad():
        expected[:, H : H + KV] = norm(expected[:, H : H + KV])  # the k heads only
    out = cpu.head_rms_norm_(qkv, H, KV, D, (1.0 + norm.weight).detach(), 1e-6)
    assert out is qkv
    torch.testing.assert_close(qkv.view(n, H + 2 * KV, D), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        cpu.head_rms_norm_(qkv, H + KV, 2 * KV, D, torch.ones(D), 1e-6)


@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (4, 4, 8), (8, 1, 24)])
def test_sliding_window_attention_matches_sdpa_and_stays_row_invariant(window, n_heads, n_kv, d):
    start, n = 20, 8
    k, v = _cache(n_kv, 64, d, start + n, seed=window + d)
    q = torch.randn(n, n_heads, d, generator=torch.Generator().manual_seed(42))
    out = cpu.attention_rows(q, k, v, start, d**-0.5, window)
    end = start + n
    # query i at position start + i sees positions start + i - window + 1 .. start + i
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start) & torch.ones(n, end, dtype=torch.bool).triu(
        diagonal=start - window + 1
    )
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[None, :, :end],
        v[None, :, :end],
        attn_mask=mask,
        scale=d**-0.5,
        enable_gqa=n_heads != n_kv,
    )
    torch.testing.assert_close(out, ref[0].transpose(0, 1).reshape(n, n_heads * d), rtol=1e-5, atol=1e-5)
    for i in range(n):
        assert torch.equal(cpu.attention_rows(q[i : i + 1], k, v, start + i, d**-0.5, window), out[i : i + 1]), i
    with pytest.raises(ValueError, match="window"):
        cpu.attention_rows(q, k, v, start, d**-0.5, 0)


# -- float16 KV caches --------------------------------------------------------


@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (8, 1, 24)])
@pytest.mark.parametrize("start,n", [(0, 1), (37, 8)])
def test_float16_cache_attention_is_float32_attention_over_the_rounded_cache(n_heads, n_kv, d, start, n):
    k, v = _cache(n_kv, 64, d, start + n, seed=start + n + 3)
    q = torch.randn(n, n_heads, d, generator=torch.Generator().manual_seed(2))
    # the same kernel over float32 copies of the float16 values: the same bits (widening is exact)
    got = cpu.attention_rows(q, k.half(), v.half(), start, d**-0.5)
    assert torch.equal(got, cpu.attention_rows(q, k.half().float(), v.half().float(), start, d**-0.5))
    assert not torch.equal(got, cpu.attention_rows(q, k, v, start, d**-0.5))  # the rounding is real


def test_float16_cache_rows_are_bitwise_independent_of_the_row_count():
    start, n_max = 20, 9
    k, v = _cache(3, 64, 64, start + n_max, seed=11)
    k, v = k.half(), v.half()
    q = torch.randn(n_max, 9, 64, generator=torch.Generator().manual_seed(12))
    full = cpu.attention_rows(q, k, v, start, 0.125)
    for first in range(n_max):
        for n in range(1, n_max - first + 1):
            assert torch.equal(
                cpu.attention_rows(q[first : first + n], k, v, start + first, 0.125), full[first : first + n]
            )


def test_rope_qkv_rounds_keys_and_values_into_a_float16_cache_once():
    n, H, KV, D = 3, 4, 2, 16
    gen = torch.Generator().manual_seed(13)
    qkv = torch.randn(n, (H + 2 * KV) * D, generator=gen)
    cos, sin = torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen)
    k32, v32 = torch.zeros(KV, 8, D), torch.zeros(KV, 8, D)
    k16, v16 = torch.zeros(KV, 8, D, dtype=torch.float16), torch.zeros(KV, 8, D, dtype=torch.float16)
    q32 = cpu.rope_qkv(qkv, H, KV, D, cos, sin, k32, v32, 2)
    q16 = cpu.rope_qkv(qkv, H, KV, D, cos, sin, k16, v16, 2)
    assert torch.equal(q16, q32)  # queries stay float32
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())  # round to nearest even, as torch


def test_caches_of_other_dtypes_are_refused_and_k_and_v_may_differ():
    k, v = _cache(2, 16, 8, 4, seed=9)
    q = torch.randn(1, 4, 8)
    with pytest.raises(TypeError, match="float32, float16, q8_0, q4_0"):
        cpu.attention_rows(q, k.bfloat16(), v.bfloat16(), 3, 1.0)
    # float16 keys with float32 values (llama.cpp's -ctk / -ctv): the float32 kernel over the rounded keys
    assert torch.equal(cpu.attention_rows(q, k.half(), v, 3, 1.0), cpu.attention_rows(q, k.half().float(), v, 3, 1.0))


# A decode step of few queries (n * H < 8 threads, 64 positions or more) runs phase by
# phase (scores by position range, lanes of the values by halves): the same bits.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_heads,n_kv,d,window", [(9, 3, 64, None), (4, 1, 24, None), (2, 2, 16, 50), (6, 2, 8, None)])
def test_few_query_attention_has_the_many_query_bits(dtype, n_heads, n_kv, d, window):
    start, n_max = 250, 6
    k, v = _cache(n_kv, start + n_max, d, start + n_max, seed=d + n_heads)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(n_max, n_heads, d, generator=torch.Generator().manual_seed(7))
    full = cpu.attention_rows(q, k, v, start, d**-0.5, window)
    mask = torch.ones(n_max, start + n_max, dtype=torch.bool).tril(diagonal=start)
    if window:
        mask &= torch.ones_like(mask).triu(diagonal=start - window + 1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.float()[None],
        v.float()[None],
        attn_mask=mask,
        scale=d**-0.5,
        enable_gqa=n_heads != n_kv,
    )
    torch.testing.assert_close(full, ref[0].transpose(0, 1).reshape(n_max, n_heads * d), rtol=1e-5, atol=1e-5)
    for first in range(n_max):
        for n in (1, 2):
            if first + n <= n_max:
                part = cpu.attention_rows(q[first : first + n], k, v, start + first, d**-0.5, window)
                assert torch.equal(part, full[first : first + n]), (first, n)


# Gemma 2's soft cap on the scores, s -> cap * tanh(s / cap), before the softmax: transformers' eager
# attention's values, and the bits of one row alone on both paths (few queries by phase, many by item).
@pytest.mark.parametrize(
    "n_heads,n_kv,d,window,cap", [(4, 2, 16, None, 1.5), (6, 3, 32, 40, 0.2), (2, 2, 8, None, 30.0)]
)
def test_soft_capped_attention_matches_eager_and_keeps_rows_alone(n_heads, n_kv, d, window, cap):
    start, n_max = 120, 9
    k, v = _cache(n_kv, start + n_max, d, start + n_max, seed=d + n_heads)
    q = torch.randn(n_max, n_heads, d, generator=torch.Generator().manual_seed(5)) * 2
    full = cpu.attention_rows(q, k, v, start, d**-0.5, window, softcap=cap)
    mask = torch.ones(n_max, start + n_max, dtype=torch.bool).tril(diagonal=start)
    if window:
        mask &= torch.ones_like(mask).triu(diagonal=start - window + 1)
    group = n_heads // n_kv
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, L, D]
    s = torch.tanh(torch.matmul(q.transpose(0, 1), kk.transpose(1, 2)) * d**-0.5 / cap) * cap  # [H, n, L]
    ref = torch.matmul(torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1), vv)  # [H, n, D]
    torch.testing.assert_close(full, ref.transpose(0, 1).reshape(n_max, n_heads * d), rtol=1e-5, atol=1e-5)
    uncapped = cpu.attention_rows(q, k, v, start, d**-0.5, window)
    assert (full - uncapped).abs().max() > 1e-3  # the cap bites
    for first in range(n_max):  # one row (by phase, at >= 64 positions) and the rest by item: the same bits
        part = cpu.attention_rows(q[first : first + 1], k, v, start + first, d**-0.5, window, softcap=cap)
        assert torch.equal(part, full[first : first + 1]), first


def test_a_layer_stack_sizes_its_work_for_every_layer():
    """Layers of one cache shape may still differ in what their projections need: here a layer
    on block formats (quantized activations) before a float one (no scratch)."""
    from fastdecode.kernels.gguf_blocks import BlockTensor
    from fastdecode.kernels.quant import Projection, pack

    H, KV, D, hidden, inter = 4, 2, 8, 32, 64
    gen = torch.Generator().manual_seed(0)

    def weight(n, k):
        return torch.randn(n, k, generator=gen) * 0.1

    def layer(blocks):
        shapes = [((H + 2 * KV) * D, hidden), (hidden, H * D), (2 * inter, hidden), (hidden, inter)]
        if blocks:
            projs = [Projection([pack(BlockTensor.quantize(weight(n, k), "q8_0"))], None, k) for n, k in shapes]
        else:
            projs = [(weight(n, k), None, None) for n, k in shapes]
        return cpu.DecoderLayerKernel(
            torch.ones(hidden), projs[0], projs[1], torch.ones(hidden), projs[2], projs[3], H, KV, D, 1e-6
        )

    layers = [layer(True), layer(False)]
    rows = cpu.PagedRows.contiguous(0, 5, 16)
    stack = cpu.LayerStack(layers)
    assert stack.work_floats(rows) == max(la.work_floats(rows) for la in layers) > layers[1].work_floats(rows)
    x = torch.randn(5, hidden, generator=gen)
    pools = [torch.zeros(1, KV, 16, D) for _ in range(4)]
    rope = [(torch.ones(5, D), torch.zeros(5, D))] * 2
    one_by_one = x.clone()
    for i, la in enumerate(layers):
        la(one_by_one, *rope[i], pools[2 + i][0], pools[2 + i][0].clone(), 0, 0.5)
    stack(x, rope, pools[:2], [p.clone() for p in pools[:2]], rows, 0.5)
    assert torch.equal(x, one_by_one)
