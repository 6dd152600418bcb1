"""A key affine over a KV cache (kv.c's kv_key_affine: keys stored as (k - mu) / s, queries taken as
q * s): the C writer's bytes are KVFormat.store's, attention over the stored rows is attention over
the keys they stand for (s * row + mu) to float32's rounding, and each row keeps its bits whatever
the row count, the implementation and the thread count."""

import pytest
import torch
from test_kv_formats import IMPLS, _q8_query, _values, rope_inputs

from fastdecode.kernels import cpu, quant
from fastdecode.kernels.gguf_blocks import QK
from fastdecode.kernels.kv_formats import FORMATS, hadamard
from fastdecode.kv.calibration import error_feedback

pytestmark = pytest.mark.skipif(cpu.rowgemm_unavailable() is not None, reason=str(cpu.rowgemm_unavailable()))

PAIRS = [("q4_0", "q4_0"), ("q8_0", "q4_0"), ("float32", "float32"), ("q4_0", "float32")]


def _affine(n_kv: int, d: int, seed: int, feedback: bool = True) -> torch.Tensor:
    """[KV, 3 + d, d] = (mu, 1 / s, s, F): a mean of a few units, scales 0.3 .. 3, and the error feedback
    of a random query moment (``feedback`` False: F = 0)."""
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(n_kv, d, generator=gen) * 2
    s = torch.exp(torch.empty(n_kv, d).uniform_(-1.2, 1.1, generator=gen))
    a = torch.randn(n_kv, d, d // 4, generator=gen, dtype=torch.float64)
    moment = (a @ a.transpose(1, 2)).numpy()  # low rank: the damping makes it invertible
    f = torch.from_numpy(error_feedback(moment, s.double().numpy())).float() if feedback else torch.zeros(n_kv, d, d)
    return torch.cat([torch.stack([mu, 1 / s, s], dim=1), f], dim=1).contiguous()


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rope_qkv_with_an_affine_writes_what_kv_format_store_writes(pair, d):
    n, H, KV = 5, 4, 2
    qkv, cos, sin = rope_inputs(n, H, KV, d, seed=d)
    fk, fv = (FORMATS[name] for name in pair)
    affine = _affine(KV, d, seed=d)
    k32, v32 = torch.zeros(KV, 8, d), torch.zeros(KV, 8, d)
    kq = torch.zeros(KV, 8, fk.row_width(d), dtype=fk.dtype)
    vq = torch.zeros(KV, 8, fv.row_width(d), dtype=fv.dtype)
    q32 = cpu.rope_qkv(qkv, H, KV, d, cos, sin, k32, v32, 2)  # the keys after RoPE, no affine
    qq = cpu.rope_qkv(qkv, H, KV, d, cos, sin, kq, vq, 2, k_affine=affine)
    assert torch.equal(qq, q32)  # the queries are returned as they are: attention applies s
    written = slice(2, 2 + n)
    assert torch.equal(kq[:, written], fk.store(k32[:, written].transpose(0, 1), affine).transpose(0, 1))
    assert torch.equal(vq[:, written], fv.store(v32[:, written]))  # values untouched
    rows = kq[:, written].transpose(0, 1)  # [n, KV, W]
    back = fk.load(rows, affine)  # [n, KV, d]: s * row + mu
    assert torch.equal(back, fk.load(rows).float() * affine[:, 2] + affine[:, 0])
    if not fk.quantized:  # float32 keys come back to float32's rounding
        torch.testing.assert_close(back, k32[:, written].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("n_heads,n_kv,d", [(9, 3, 64), (8, 1, 32), (4, 2, 96)])
@pytest.mark.parametrize("start,n", [(0, 1), (37, 8), (250, 3)])
def test_attention_with_an_affine_is_attention_over_the_keys_the_rows_stand_for(pair, n_heads, n_kv, d, start, n):
    """Scores (q s).((k - mu) / s) = q.k - q.mu: a constant per query, which softmax drops. Against the
    dequantized, untransformed keys s * row + mu queried by the query the kernel takes (q * s rounded
    to int8 blocks for quantized keys, divided by s again)."""
    fk, fv = (FORMATS[name] for name in pair)
    affine = _affine(n_kv, d, seed=start + d)
    keys = _values(n_kv, start + n, d, seed=start + n + d).transpose(0, 1)  # [cap, KV, d]
    kq = fk.store(keys + affine[:, 0], affine).transpose(0, 1).contiguous()  # keys of mean ~mu, [KV, cap, W]
    vq = fv.store(_values(n_kv, start + n, d, seed=start + n + d + 1))
    q = torch.randn(n, n_heads, d, generator=torch.Generator().manual_seed(2))
    got = cpu.attention_rows(q, kq, vq, start, d**-0.5, k_affine=affine)
    s = affine[:, 2].repeat_interleave(n_heads // n_kv, dim=0)  # [H, d]: each head's KV group's
    qk = hadamard(q * s) if fk.rotated else q * s
    if fk.quantized:
        qk = _q8_query(qk)
    q_taken = (hadamard(qk) if fk.rotated else qk) / s
    ref = torch.nn.functional.scaled_dot_product_attention(
        q_taken.transpose(0, 1)[None],
        fk.load(kq.transpose(0, 1), affine).transpose(0, 1)[None],  # the keys the rows stand for
        fv.load(vq).float()[None],
        attn_mask=torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start),
        scale=d**-0.5,
        enable_gqa=n_heads != n_kv,
    )
    torch.testing.assert_close(got, ref[0].transpose(0, 1).reshape(n, n_heads * d), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pair", PAIRS[:2])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_with_an_affine_keep_their_bits_at_any_row_count(pair, impl, threads):
    """1, 3 and 8 rows of 9, paged, against one pass of 9; and every implementation the CPU has the same."""
    n_max, d, n_kv, H, B, start = 9, 64, 3, 9, 16, 200
    blocks = (start + n_max + B - 1) // B
    fk, fv = (FORMATS[name] for name in pair)
    affine = _affine(n_kv, d, seed=7)
    kq = fk.store(_values(n_kv, blocks * B, d, seed=3).transpose(0, 1), affine).transpose(0, 1)
    vq = fv.store(_values(n_kv, blocks * B, d, seed=4))
    kp, vp = (p.reshape(n_kv, blocks, B, -1).transpose(0, 1).contiguous() for p in (kq, vq))
    table = torch.arange(blocks)[None]
    q = torch.randn(n_max, H, d, generator=torch.Generator().manual_seed(12))

    def attend(first, n, which=impl):
        rows = cpu.PagedRows(
            torch.arange(start + first, start + first + n), torch.zeros(n, dtype=torch.int64), table, B
        )
        return cpu.attention_rows(q[first : first + n], kp, vp, 0, 0.125, rows=rows, impl=which, k_affine=affine)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        full = attend(0, n_max)
        for first in range(n_max):
            for n in (1, 3, 8):
                if first + n <= n_max:
                    assert torch.equal(attend(first, n), full[first : first + n]), (first, n)
        for other in quant.supported_impls():
            if other in ("avx2", "avx512_vnni"):
                assert torch.equal(attend(0, n_max, other), full), other
    finally:
        torch.set_num_threads(before)


def test_a_bad_affine_is_refused():
    q, k = torch.randn(1, 4, 64), FORMATS["q4_0"].store(torch.randn(2, 8, 64))
    with pytest.raises(ValueError, match=r"\[KV, 3 \+ head_dim, head_dim\]"):
        cpu.attention_rows(q, k, k, 3, 1.0, k_affine=torch.ones(2, 3, 64))
    with pytest.raises(TypeError, match="float32"):
        cpu.attention_rows(q, k, k, 3, 1.0, k_affine=torch.ones(2, 67, 64, dtype=torch.float64))


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_no_error_feedback_is_ggml_rounding(name):
    """F = 0: the C writer and KVFormat.store round each block as ggml does, the rows of (k - mu) / s."""
    n, H, KV, d = 6, 4, 2, 64
    qkv, cos, sin = rope_inputs(n, H, KV, d, seed=7)
    fk = FORMATS[name]
    affine = _affine(KV, d, seed=3, feedback=False)
    k32, v32 = torch.zeros(KV, 8, d), torch.zeros(KV, 8, d)
    kq, vq = torch.zeros(KV, 8, fk.row_width(d), dtype=fk.dtype), torch.zeros(KV, 8, d)
    cpu.rope_qkv(qkv, H, KV, d, cos, sin, k32, v32, 0)
    cpu.rope_qkv(qkv, H, KV, d, cos, sin, kq, vq, 0, k_affine=affine)
    keys = k32[:, :n].transpose(0, 1)  # [n, KV, d]
    plain = fk.store((keys - affine[:, 0]) * affine[:, 1])  # ggml's blocks, no affine argument
    assert torch.equal(fk.store(keys, affine), plain)
    assert torch.equal(kq[:, :n].transpose(0, 1), plain)


def test_error_feedback_leaves_less_error_where_the_queries_look():
    """Over 512 rows, the score error a query of the moment F was fitted to sees, e^T C e with e the
    stored row's error, is smaller with the feedback than with ggml's rounding of the same rows (q4_0:
    the rotated rows F is fitted for)."""
    name = "q4_0"
    from fastdecode.kv.calibration import error_feedback

    d, gen = 64, torch.Generator().manual_seed(11)
    basis = torch.randn(d, 6, generator=gen, dtype=torch.float64)
    moment = (basis @ basis.T + 0.05 * torch.eye(d, dtype=torch.float64))[None]  # queries near 6 directions
    s = torch.ones(1, d)
    f = torch.from_numpy(error_feedback(moment.numpy(), s.double().numpy())).float()
    affine = torch.cat([torch.stack([torch.zeros(1, d), s, s], dim=1), f], dim=1)
    fk = FORMATS[name]
    x = torch.randn(512, 1, d, generator=gen) * 2

    def seen(rows):  # mean e^T C e over the rows
        e = (fk.load(rows) - x)[:, 0].double()
        return ((e @ moment[0]) * e).sum(-1).mean().item()

    assert seen(fk.store(x, affine)) < 0.7 * seen(fk.store(x))


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
@pytest.mark.parametrize("d", [32, 64, 96])
def test_the_c_and_the_torch_feedback_writers_give_the_same_bytes(name, d):
    from fastdecode.kernels.kv_formats import store_feedback

    gen = torch.Generator().manual_seed(d)
    affine = _affine(3, d, seed=d)  # [3, 3 + d, d]
    x = torch.randn(300, d, generator=gen) * 3  # more rows than the C loop's threading threshold
    x[5] = 0  # an all-zero row: scale 0
    x[6, :QK] = -0.0  # a block of negative zeros
    x[7] *= 1e6  # scales past float16's range: inf
    x[8] *= 1e-41  # subnormal values: a scale whose inverse is not finite
    x[9, 3] = 1e30  # one value past float16's range among small ones
    index = torch.randint(0, 3, (300,), generator=gen)
    native = store_feedback(x, affine, index, name)
    assert torch.equal(native, store_feedback(x, affine, index, name, native=False))
    plain = affine.clone()
    plain[:, 3:] = 0
    assert not torch.equal(native, store_feedback(x, plain, index, name))  # F is used


def test_rows_of_several_heads_are_stored_with_their_own_heads_affine():
    """KVFormat.store(x, affine, heads): a policy's moves per lane, row r with head heads[r]'s affine; the
    same bytes as storing each head's rows with the whole affine."""
    fk, d = FORMATS["q4_0"], 64
    affine = _affine(3, d, seed=5)
    x = torch.randn(40, 3, d, generator=torch.Generator().manual_seed(5)) * 3
    whole = fk.store(x, affine)  # [40, 3, W]
    heads = torch.arange(120) % 3
    rows = x.reshape(120, d)
    assert torch.equal(fk.store(rows, affine, heads=heads), whole.reshape(120, -1))


def test_bad_feedback_arguments_are_refused():
    from fastdecode.kernels.kv_formats import store_feedback

    affine = _affine(2, 64, seed=1)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="one head index a row"):
        store_feedback(x, affine, torch.tensor([0, 1, 2, 0]), "q4_0")
    with pytest.raises(ValueError, match="q8_0 or q4_0 rows"):
        store_feedback(x, affine, torch.zeros(4, dtype=torch.int64), "float16")
    with pytest.raises(ValueError, match="q8_0 or q4_0 rows"):
        store_feedback(torch.randn(4, 48), affine, torch.zeros(4, dtype=torch.int64), "q4_0")
