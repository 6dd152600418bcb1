"""GGUF's K-quants Q4_K and Q6_K (fastdecode.kernels.gguf_blocks) on the integer block kernels
(fastdecode.kernels.quant): the file's exact weights, the same bits on every path."""

import numpy as np
import pytest
import torch
from block_checks import assert_rows_bitwise_invariant, block_acts
from gguf_files import finish_gguf

from fastdecode.formats.gguf_match import GGUFBlocks
from fastdecode.kernels import quant
from fastdecode.kernels.gguf_blocks import K_FORMATS, QK_K, BlockRows, BlockTensor, llama_unpermute

KFMTS = list(K_FORMATS)
needs_c = pytest.mark.skipif(quant.kernel_unavailable() is not None, reason=str(quant.kernel_unavailable()))


def random_k_blocks(fmt: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-2) -> BlockTensor:
    """Random super-block bytes (every bit pattern of quants and 6-bit / int8 scales is valid),
    with finite fp16 d (and dmin) of size ``scale``, some of them +0 and -0."""
    f = K_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // QK_K, f.block_bytes), dtype=np.uint8)
    for at in (0, 2) if fmt == "q4_k" else (208,):
        d = (rng.standard_normal(b.shape[:2]) * scale).astype(np.float16)
        d.flat[::7] = 0.0
        d.flat[3::11] = -0.0
        b[..., at : at + 2] = d[..., None].view(np.uint8)
    return BlockTensor(f, b.reshape(rows, -1), cols)


def _bits(t):
    return np.ascontiguousarray(np.asarray(t, dtype=np.float32)).view(np.int32)


# -- formats -------------------------------------------------------------


@pytest.mark.parametrize("fmt", KFMTS)
def test_k_quants_dequantize_bit_for_bit_as_gguf_does(fmt):
    from gguf import quants

    bt = random_k_blocks(fmt, 37, 3 * QK_K)
    assert (bt.rows, bt.cols, bt.n_blocks) == (37, 768, 24)
    ours = bt.dequantize()
    assert np.array_equal(
        _bits(ours), _bits(quants.dequantize(bt.blocks, K_FORMATS[fmt].ggml_type))
    )  # zeros' signs too


@pytest.mark.parametrize("fmt", KFMTS)
def test_fields_are_blocks_of_32_with_float32_scales(fmt):
    bt = random_k_blocks(fmt, 5, 512)
    q, d, m = bt.fields()
    per = K_FORMATS[fmt].scales_per_block
    assert q.shape == (5, 16, 32) and d.shape == (5, 16, per) and d.dtype == np.float32
    if fmt == "q4_k":
        assert q.dtype == np.uint8 and q.max() <= 15 and m.shape == (5, 16) and m.dtype == np.float32
    else:
        assert q.dtype == np.int8 and q.min() >= -32 and q.max() <= 31 and m is None and per == 2
    # one block's weights from its fields alone
    w = bt.dequantize().view(5, 16, 2, 16)
    b = 9
    if fmt == "q4_k":
        assert torch.equal(w[2, b].flatten(), torch.from_numpy(d[2, b, 0] * q[2, b].astype(np.float32) + m[2, b]))
    else:
        for h in range(2):
            assert torch.equal(
                w[2, b, h], torch.from_numpy(d[2, b, h] * q[2, b, 16 * h : 16 * h + 16].astype(np.float32))
            )


def test_k_quant_refusals():
    f = K_FORMATS["q4_k"]
    with pytest.raises(ValueError, match="super-blocks of 256"):
        BlockTensor(f, np.zeros((2, f.block_bytes), np.uint8), 200)
    with pytest.raises(ValueError, match="bytes"):
        BlockTensor(f, np.zeros((2, f.block_bytes + 1), np.uint8), 256)
    with pytest.raises(ValueError, match="taken from a GGUF file"):
        BlockTensor.quantize(torch.randn(4, 256), "q6_k")


@pytest.fixture(scope="module")
def k_gguf(tmp_path_factory):
    """A GGUF file written by gguf's own writer holding Q4_K and Q6_K tensors (raw super-block
    bytes), one a Llama k projection stored permuted for ggml's RoPE."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path_factory.mktemp("gguf") / "kquants.gguf"
    writer = GGUFWriter(str(path), "llama")
    tensors = {
        "blk.0.ffn_down.weight": random_k_blocks("q6_k", 24, 512, seed=3),
        "blk.0.attn_output.weight": random_k_blocks("q4_k", 16, 256, seed=4),
    }
    k = random_k_blocks("q4_k", 32, 256, seed=5)  # 2 KV heads of 16; HF row order
    tensors["blk.0.attn_k.weight"] = k.take_rows(np.argsort(llama_unpermute(32, 2)))
    for name, bt in tensors.items():
        writer.add_tensor(name, bt.blocks, raw_dtype=GGMLQuantizationType(bt.format.ggml_type))
    finish_gguf(writer)
    return path, tensors, k


def test_k_quants_read_from_a_file(k_gguf):
    from gguf import GGUFReader, quants

    path, tensors, k = k_gguf
    ours = GGUFBlocks(str(path))
    reader = {t.name: t for t in GGUFReader(str(path)).tensors}
    for name, written in tensors.items():
        bt = ours.blocks(name)
        assert bt.format == written.format and (bt.rows, bt.cols) == (written.rows, written.cols)
        assert np.array_equal(bt.blocks, reader[name].data)
        assert np.array_equal(
            _bits(bt.dequantize()), _bits(quants.dequantize(reader[name].data, reader[name].tensor_type))
        )
    assert ours.type_name("blk.0.ffn_down.weight") == "q6_k"
    # matching: rows un-permuted whole (a super-block is part of one row), viewed where they lie
    found, why = ours.matching("model.layers.0.self_attn.k_proj", k.dequantize(), 4, 2)
    assert why == "" and found.format.name == "q4_k" and isinstance(found, BlockRows)
    assert np.array_equal(found.materialize().blocks, k.blocks)
    found, why = ours.matching("model.layers.0.mlp.down_proj", tensors["blk.0.ffn_down.weight"].dequantize(), 4, 2)
    assert why == "" and found.format.name == "q6_k"
    wrong = tensors["blk.0.attn_output.weight"].dequantize()
    wrong[:, 200] += 1.0  # past the first block of 32, inside the first super-block
    found, why = ours.matching("model.layers.0.self_attn.o_proj", wrong, 4, 2)
    assert found is None and "does not dequantize" in why


# -- kernels ---------------------------------------------------------------


def _dequantized_acts(x):
    q, d = quant.quantize_rows_reference(x)[:2]
    return (q.double() * d.double()[..., None]).reshape(x.shape[0], -1)[:, : x.shape[1]]


@needs_c
@pytest.mark.parametrize("fmt", KFMTS)
@pytest.mark.parametrize("n,k", [(1, 256), (13, 512), (8, 768), (45, 256)])
def test_kernels_equal_the_reference_and_a_float_reference(fmt, n, k):
    bt = random_k_blocks(fmt, n, k, seed=n)
    bias = torch.randn(n)
    packed = quant.pack(bt)
    for m in (1, 2, 7, 16):
        x = block_acts(m, k, seed=m)
        ref = quant.block_linear_reference(x, [bt], bias)
        for impl in quant.supported_impls():
            assert torch.equal(quant.Projection([packed], bias, k, impl)(x), ref), (impl, m)
        # the same blocks in float64: only the float32 roundings of the block sums differ
        exact = _dequantized_acts(x) @ bt.dequantize().double().T + bias.double()
        scale = _dequantized_acts(x).abs() @ bt.dequantize().double().abs().T + 1
        assert ((ref.double() - exact).abs() <= 1e-6 * scale).all()


@needs_c
@pytest.mark.parametrize("fmt", KFMTS)
def test_extreme_quants_do_not_overflow_the_int16_sums(fmt):
    """Q6_K's q - 32 = -32 everywhere against activations of +-127: each half's four
    chunks sum to 4 * 2 * 32 * 127 = 32512 in int16 lanes; Q4_K at q = 15 as Q4_1's."""
    f = K_FORMATS[fmt]
    b = np.zeros((8, f.block_bytes), np.uint8)
    if fmt == "q6_k":
        b[:, 192:208] = 127  # scales; ql = qh = 0: q - 32 = -32
        b[:, 208:210] = np.full((8, 1), 1.0, np.float16).view(np.uint8)
    else:
        b[:, 0:4] = np.full((8, 2), 1.0, np.float16).view(np.uint8)
        b[:, 4:16] = 0xFF  # every sc and m 63
        b[:, 16:] = 0xFF  # q = 15
    bt = BlockTensor(f, b, QK_K)
    x = torch.full((3, QK_K), 2.0)
    x[1, ::2] = -2.0
    ref = quant.block_linear_reference(x, [bt])
    for impl in quant.supported_impls():
        assert torch.equal(quant.Projection([quant.pack(bt)], None, QK_K, impl)(x), ref), impl
    w = bt.dequantize().double()
    torch.testing.assert_close(ref.double(), x.double() @ w.T, rtol=1e-6, atol=0)


@needs_c
@pytest.mark.parametrize("fmt", KFMTS)
def test_rows_are_bitwise_invariant_to_row_count_and_threads(fmt):
    n, k = 45, 512  # an odd last group
    bt = random_k_blocks(fmt, n, k)
    x = block_acts(16, k)
    full = assert_rows_bitwise_invariant(bt, x)
    for m in range(1, 17):
        assert torch.equal(quant.block_linear_reference(x[m - 1 : m], [bt]), full[m - 1 : m]), m


@needs_c
def test_a_fused_projection_of_k_quant_and_legacy_parts():
    """A fused QKV or gate_up whose parts differ in format: each part its own kernel."""
    k = 256
    parts = [
        random_k_blocks("q4_k", 16, k, seed=1),
        random_k_blocks("q6_k", 5, k, seed=2),
        BlockTensor.quantize(block_acts(11, k, seed=3), "q8_0"),
        random_k_blocks("q4_k", 3, k, seed=4),
    ]
    bias = torch.randn(35)
    x = block_acts(6, k)
    y = quant.Projection([quant.pack(p) for p in parts], bias, k)(x)
    assert torch.equal(y, quant.block_linear_reference(x, parts, bias))
    lo = 0
    for p in parts:
        assert torch.equal(y[:, lo : lo + p.rows], quant.block_linear_reference(x, [p], bias[lo : lo + p.rows]))
        lo += p.rows


@needs_c
@pytest.mark.parametrize("fmt", KFMTS)
def test_super_block_units_give_the_reference_bits_at_1_3_8_rows(fmt):
    """Packed in units of a super-block, its scales (Q6_K's 144 bytes padded to 160) then its eight
    blocks' quants (Q6_K's nibbles and a two-bit plane): the torch reference's bits at 1, 3 and 8 rows,
    and each row its bits alone."""
    n, k = 19, 3 * QK_K
    bt = random_k_blocks(fmt, n, k, seed=5)
    unit = 160 + 8 * (192 if fmt == "q6_k" else 128)
    assert quant.pack(bt).data.numel() == -(-n // quant.GROUP) * (k // QK_K) * unit
    x = block_acts(8, k, seed=3)
    for impl in quant.supported_impls():
        proj = quant.Projection([quant.pack(bt)], None, k, impl)
        for m in (1, 3, 8):
            y = proj(x[:m])
            assert torch.equal(y, quant.block_linear_reference(x[:m], [bt])), (impl, m)
            assert torch.equal(proj(x[m - 1 : m]), y[m - 1 :]), (impl, m)
