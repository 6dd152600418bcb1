"""Quantized KV caches (q8_0, q4_0: ggml's blocks of 32 values with an fp16 scale, kernels/kv.c):
rows written with ggml's reference rounding (q4_0 of the Hadamard-rotated row), read by the
attention kernel directly as attention over the dequantized values (the query rounded to int8
blocks), and each row's bits independent of the rest."""

import pytest
import torch

from fastdecode.kernels import cpu, quant
from fastdecode.kernels.kv_formats import FORMATS, hadamard, parse_kv_cache_dtype, pool_format

pytestmark = pytest.mark.skipif(cpu.rowgemm_unavailable() is not None, reason=str(cpu.rowgemm_unavailable()))

# (keys, values): one type for both, and keys and values apart (llama.cpp's -ctk / -ctv)
PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("float16", "q4_0"), ("q4_0", "float32")]
# the attention's loops over a quantized cache: ymm (AVX2, any CPU the kernels run on) and zmm (AVX-512 VNNI)
IMPLS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in quant.supported_impls(), reason=f"no {name} here"))
    for name in ("avx2", "avx512_vnni")
]


def rope_inputs(n: int, H: int, KV: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused QKV output [n, (H + 2 KV) d] of a few units and random cos, sin [n, d] rows for rope_qkv."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (H + 2 * KV) * d, generator=gen) * 3
    return qkv, torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)


def _values(n_kv: int, capacity: int, d: int, seed: int) -> torch.Tensor:
    """[KV, capacity, d] of varied scales, with an all-zero block (scale 0) and a lone outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_kv, capacity, d, generator=gen) * torch.rand(n_kv, capacity, 1, generator=gen) * 4
    x[0, capacity // 2, :32] = 0.0
    x[-1, capacity - 1, 5] = -40.0
    return x


def _widened(fmt, pool: torch.Tensor) -> torch.Tensor:
    """The float32 values the kernel reads from a pool (a rotated format's rotated values)."""
    return fmt.dequantize(pool) if fmt.quantized else pool.float()


def _pools(pair, n_kv, capacity, d, seed):
    """(quantized K, V pools, float32 pools holding the values the kernel reads from them)."""
    fk, fv = (FORMATS[name] for name in pair)
    kq, vq = fk.store(_values(n_kv, capacity, d, seed)), fv.store(_values(n_kv, capacity, d, seed + 1))
    return kq, vq, _widened(fk, kq), _widened(fv, vq)


def test_row_sizes_and_formats():
    assert FORMATS["q8_0"].row_bytes(64) == 68 and FORMATS["q4_0"].row_bytes(64) == 36
    assert FORMATS["float32"].row_bytes(64) == 256 and FORMATS["float16"].row_bytes(64) == 128
    for name in ("q8_0", "q4_0", "float16"):
        pool = torch.empty(3, 2, 16, FORMATS[name].row_width(64), dtype=FORMATS[name].dtype)
        assert pool_format(pool, 64) is FORMATS[name]
    assert pool_format(torch.empty(2, 16, 50, dtype=torch.uint8), 64) is None
    assert FORMATS["q8_0"].fits(48) is not None and FORMATS["q8_0"].fits(96) is None
    assert parse_kv_cache_dtype("q8_0/q4_0", torch.float32) == (FORMATS["q8_0"], FORMATS["q4_0"])
    assert parse_kv_cache_dtype("auto", torch.float32) == (FORMATS["float32"],) * 2
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        parse_kv_cache_dtype("q5_0", torch.float32)


# half a step d / 2 (q4_0: a whole step at the clamped end, +8 d), plus the fp16 rounding of d times |q|
@pytest.mark.parametrize("name,bound", [("q8_0", (0.5 + 127 / 2048) / 127), ("q4_0", (1 + 8 / 2048) / 8)])
def test_a_stored_value_is_within_a_step_of_its_block(name, bound):
    fmt = FORMATS[name]
    x = _values(2, 40, 64, seed=1)
    x[1, 7] = 0.0  # a row of zeros (its blocks too, rotated or not)
    held = hadamard(x) if fmt.rotated else x  # what the blocks hold
    err = (fmt.dequantize(fmt.store(x)) - held).abs().view(2, 40, 2, 32)
    amax = held.abs().view(2, 40, 2, 32).amax(-1, keepdim=True)
    assert (err <= amax * bound * 1.001 + 1e-7).all()
    assert torch.equal(fmt.load(fmt.store(x))[1, 7], torch.zeros(64))  # zeros stay zeros
    if fmt.rotated:  # H orthonormal: the error's norm is the blocks' error norm, rotated back
        back = (fmt.load(fmt.store(x)) - x).norm(dim=-1)
        torch.testing.assert_close(back, err.view(2, 40, 64).norm(dim=-1), rtol=1e-4, atol=1e-5)


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for d in (32, 64, 96, 128):  # 96: blocks of 32
        x = torch.randn(5, d, generator=torch.Generator().manual_seed(d))
        h = hadamard(torch.eye(d))
        g = d & -d
        assert torch.equal(h, h.T) and torch.equal(h[:g, g:], torch.zeros(g, d - g))
        torch.testing.assert_close(h @ h, torch.eye(d), rtol=0, atol=1e-6)
        torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=0, atol=1e-5)
        torch.testing.assert_close(hadamard(x), x @ h.T, rtol=0, atol=1e-5)
    # an outlier channel is spread over its group: q4_0's block scale then fits the rest
    x = torch.zeros(64)
    x[5] = 8.0
    assert torch.equal(hadamard(x).abs(), torch.full((64,), 1.0))


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rope_qkv_writes_ggml_reference_blocks(pair, d):
    """The C writer's bytes are gguf_blocks' (ggml's quantize_row_*_ref) of the float32 rows."""
    n, H, KV = 5, 4, 2
    qkv, cos, sin = rope_inputs(n, H, KV, d, seed=d)
    qkv[1, (H + KV) * d : (H + KV) * d + 32] = 0.0  # a value block of zeros
    fk, fv = (FORMATS[name] for name in pair)
    k32, v32 = torch.zeros(KV, 8, d), torch.zeros(KV, 8, d)
    kq = torch.zeros(KV, 8, fk.row_width(d), dtype=fk.dtype)
    vq = torch.zeros(KV, 8, fv.row_width(d), dtype=fv.dtype)
    q32 = cpu.rope_qkv(qkv, H, KV, d, cos, sin, k32, v32, 2)
    qq = cpu.rope_qkv(qkv, H, KV, d, cos, sin, kq, vq, 2)
    assert torch.equal(qq, q32)  # queries stay float32
    written = slice(2, 2 + n)
    assert torch.equal(kq[:, written], fk.store(k32[:, written])) and torch.equal(
        vq[:, written], fv.store(v32[:, written])
    )


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (8, 1, 32), (4, 2, 96)])
@pytest.mark.parametrize("start,n", [(0, 1), (37, 8), (0, 37), (250, 1), (250, 3)])
def test_attention_over_a_quantized_cache_is_attention_over_its_values(pair, n_heads, n_kv, d, start, n):
    """To float32's rounding: scores over quantized keys run on integers against the query's
    int8 blocks (kv.c's kv_quantize_query), and the values' block scale is folded into each
    weight, so the float32 kernel over the dequantized cache, queried with those int8 blocks,
    gives the same numbers but for the order of roundings.
    (start 250: the few-query decode path, scores split by positions, values by halves of D.)"""
    kq, vq, kf, vf = _pools(pair, n_kv, start + n, d, seed=start + n + d)
    fk, fv = (FORMATS[name] for name in pair)
    q = torch.randn(n, n_heads, d, generator=torch.Generator().manual_seed(2))
    got = cpu.attention_rows(q, kq, vq, start, d**-0.5)
    # rotated keys meet rotated queries, rotated values give a rotated sum, rotated back (kv.c)
    qk = hadamard(q) if fk.rotated else q
    if fk.quantized:  # scores on integers: the query rounded to int8 blocks, the sums exact
        qk = _q8_query(qk)
    same = cpu.attention_rows(qk, kf, vf, start, d**-0.5)
    if fv.rotated:
        same = hadamard(same.view(n, n_heads, d)).view(n, n_heads * d)
    # (dq dk) * a block's integer sum, and (p dv) * q for the values: other roundings than the float chain's
    torch.testing.assert_close(got, same, rtol=1e-5, atol=1e-5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        (hadamard(qk) if fk.rotated else qk).transpose(0, 1)[None],  # the query the kernel takes, unrotated
        fk.load(kq).float()[None],  # the values the rows stand for
        fv.load(vq).float()[None],
        attn_mask=torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start),
        scale=d**-0.5,
        enable_gqa=n_heads != n_kv,
    )
    tol = 1e-4 if fk.rotated or fv.rotated else 1e-5  # the rotation's float32 rounding
    torch.testing.assert_close(got, ref[0].transpose(0, 1).reshape(n, n_heads * d), rtol=tol, atol=tol)


def _q8_query(q: torch.Tensor) -> torch.Tensor:
    """q's values as kv.c's kv_quantize_query rounds them: int8 blocks of 32, a float32 scale amax / 127."""
    b = q.reshape(*q.shape[:-1], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    x = b * torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (x.sign() * (x.abs() + 0.5).floor() * d).reshape(q.shape)  # roundf: halves away from zero


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pair", PAIRS[:3])
@pytest.mark.parametrize("start", [20, 250])
def test_quantized_cache_rows_are_bitwise_independent_of_the_row_count(pair, start, impl):
    """Row invariance at 1, 3 and 8 rows (and every split of 9), paged over shuffled blocks."""
    n_max, d, n_kv, B = 9, 64, 3, 16
    blocks = (start + n_max + B - 1) // B
    kq, vq, _, _ = _pools(pair, n_kv, blocks * B, d, seed=start)
    order = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(5))[:blocks]

    def paged(pool):  # [KV, cap, W] -> [blocks + 3, KV, B, W] with position t in block order[t // B]
        out = torch.zeros(blocks + 3, n_kv, B, pool.shape[-1], dtype=pool.dtype)
        out[order] = pool.reshape(n_kv, blocks, B, -1).transpose(0, 1)
        return out

    kp, vp = paged(kq), paged(vq)
    q = torch.randn(n_max, 9, d, generator=torch.Generator().manual_seed(12))

    def attend(first, n):
        rows = cpu.PagedRows(
            torch.arange(start + first, start + first + n), torch.zeros(n, dtype=torch.int64), order[None].clone(), B
        )
        return cpu.attention_rows(q[first : first + n], kp, vp, 0, 0.125, rows=rows, impl=impl)

    full = attend(0, n_max)
    assert torch.equal(full, cpu.attention_rows(q, kq, vq, start, 0.125, impl=impl))  # paging changes nothing
    for first in range(n_max):
        for n in (1, 3, 8):
            if first + n <= n_max:
                assert torch.equal(attend(first, n), full[first : first + n]), (first, n)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (8, 1, 32), (4, 2, 96), (2, 1, 256)])
@pytest.mark.parametrize("block_size", [16, 5, 40])
def test_every_implementation_gives_the_same_bits(pair, n_heads, n_kv, d, block_size):
    """The zmm loops (kv_avx512.c: sixteen positions, several queries' values at once) against the ymm
    ones: the same integers, the same float32 operations per position and output lane. Paged over
    blocks that cut the sixteens anywhere, at 1 (the few-query path), 2, 3 and 40 rows, and one thread."""
    impls = [name for name in ("avx2", "avx512_vnni") if name in quant.supported_impls()]
    if len(impls) < 2:
        pytest.skip("one implementation here")
    capacity = -(-300 // block_size) * block_size
    kq, vq, _, _ = _pools(pair, n_kv, capacity, d, seed=d + block_size)
    paged = [pool.view(n_kv, -1, block_size, pool.shape[-1]).transpose(0, 1).contiguous() for pool in (kq, vq)]
    order = torch.arange(paged[0].shape[0]).flip(0)[None].contiguous()  # blocks in reverse order
    q = torch.randn(40, n_heads, d, generator=torch.Generator().manual_seed(d))
    for start, n in [(260, 1), (37, 3), (0, 40), (131, 1), (7, 1), (200, 2)]:
        rows = cpu.PagedRows(torch.arange(start, start + n), torch.zeros(n, dtype=torch.int64), order, block_size)
        outs = [cpu.attention_rows(q[:n], *paged, 0, d**-0.5, rows=rows, impl=impl) for impl in impls]
        for impl, out in zip(impls[1:], outs[1:]):
            assert torch.equal(out, outs[0]), (impl, start, n)
        window = cpu.attention_rows(q[:n], *paged, 0, d**-0.5, window=50, rows=rows, impl=impls[-1])
        assert torch.equal(window, cpu.attention_rows(q[:n], *paged, 0, d**-0.5, window=50, rows=rows, impl="avx2"))
        before = torch.get_num_threads()
        try:  # one thread: the zmm loops' items hold a group's queries together
            torch.set_num_threads(1)
            assert torch.equal(cpu.attention_rows(q[:n], *paged, 0, d**-0.5, rows=rows, impl=impls[-1]), outs[0])
        finally:
            torch.set_num_threads(before)


@pytest.mark.parametrize("pair", [("q8_0", "q8_0"), ("q4_0", "q8_0")])
def test_two_threads_give_each_row_its_one_row_bits(pair):
    n, H, KV, D = 37, 4, 2, 32
    kq, vq, _, _ = _pools(pair, KV, 64, D, seed=11)
    q = torch.randn(n, H, D, generator=torch.Generator().manual_seed(11))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rows = cpu.attention_rows(q, kq, vq, 0, 0.25)
        one = torch.cat([cpu.attention_rows(q[i : i + 1], kq, vq, i, 0.25) for i in range(n)])
        torch.set_num_threads(1)
        single = cpu.attention_rows(q, kq, vq, 0, 0.25)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(rows, one) and torch.equal(rows, single)


def test_kv_mirror_copies_quantized_rows():
    fk, fv = FORMATS["q8_0"], FORMATS["q4_0"]
    k = fk.store(_values(2, 4 * 8, 64, seed=3)).view(2, 4, 8, -1).transpose(0, 1).contiguous()  # [blocks, KV, B, W]
    v = fv.store(_values(2, 4 * 8, 64, seed=4)).view(2, 4, 8, -1).transpose(0, 1).contiguous()
    tables = torch.tensor([[0, 1], [2, 3]])
    mirrors = torch.tensor([[0, 1, 9]])  # row 0 (sequence 0, position 9) to position 9 of sequence 1
    rows = cpu.PagedRows(torch.tensor([9]), torch.tensor([0]), tables, 8, mirrors)
    cpu.kv_mirror(k, v, rows, 64)
    assert torch.equal(k[3, :, 1], k[1, :, 1]) and torch.equal(v[3, :, 1], v[1, :, 1])


def test_bad_quantized_pools_are_refused():
    q = torch.randn(1, 4, 64)
    k = FORMATS["q8_0"].store(torch.randn(2, 8, 64))
    with pytest.raises(ValueError, match="q8_0, q4_0"):
        cpu.attention_rows(q, k[..., :-1].contiguous(), k, 3, 1.0)  # a row one byte short
    with pytest.raises(ValueError, match="one shape but the row"):
        cpu.attention_rows(q, k, k[:, :4].contiguous(), 3, 1.0)


def test_the_format_codes_match_kv_c():
    from pathlib import Path

    from fastdecode.kernels import abi

    source = (Path(abi.__file__).parent / "kv.c").read_text()
    for name, code in abi.KV_FORMATS.items():
        macro = {"float32": "KV_F32", "float16": "KV_F16"}.get(name, f"KV_{name.upper()}")
        assert f"#define {macro} {code}\n" in source, name
    assert f"#define KV_ROTATED {abi.KV_ROTATED}\n" in source
    assert FORMATS["q4_0"].code == abi.KV_FORMATS["q4_0"] | abi.KV_ROTATED and FORMATS["q8_0"].code == 2
