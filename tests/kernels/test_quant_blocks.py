"""GGUF block formats (fastdecode.kernels.gguf_blocks) and their integer-dot-product kernels (fastdecode.kernels.quant)."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from block_checks import ALL_IMPLS, assert_rows_bitwise_invariant, block_acts
from gguf_files import finish_gguf

from fastdecode.formats.gguf_match import GGUFBlocks
from fastdecode.kernels import quant
from fastdecode.kernels.gguf_blocks import FORMATS, QK, BlockTensor, gguf_tensor_names, llama_unpermute

FMTS = list(FORMATS)
needs_c = pytest.mark.skipif(quant.kernel_unavailable() is not None, reason=str(quant.kernel_unavailable()))


def _weight(rows, cols, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
    if rows > 2:
        w[1] = 0.0  # a row of empty blocks (d = 0)
        w[2, : min(cols, 40)] = 0.25  # a constant block (Q4_1: d = 0, m != 0)
    return w


def _dequantized_acts(x):
    q, d = quant.quantize_rows_reference(x)[:2]
    return (q.double() * d.double()[..., None]).reshape(x.shape[0], -1)[:, : x.shape[1]]


# -- formats -------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_is_ggml_reference_rounding(fmt):
    from gguf import quants

    w = _weight(300, 256) * 10.0 ** torch.randint(-3, 3, (300, 1)).float()
    w[5] = torch.round(w[5] * 4) / 4 + 0.0  # ties; + 0.0: no negative zeros (their sign is unspecified)
    ours = BlockTensor.quantize(w, fmt)
    assert np.array_equal(ours.blocks, quants.quantize(w.numpy(), FORMATS[fmt].ggml_type))
    assert torch.equal(ours.dequantize(), torch.from_numpy(quants.dequantize(ours.blocks, FORMATS[fmt].ggml_type)))


@pytest.mark.parametrize("fmt", FMTS)
def test_odd_widths_are_padded_with_zero_weights(fmt):
    w = _weight(5, 40)
    bt = BlockTensor.quantize(w, fmt)
    assert (bt.rows, bt.cols, bt.n_blocks) == (5, 40, 2)
    padded = BlockTensor.quantize(torch.nn.functional.pad(w, (0, 24)), fmt)
    assert np.array_equal(bt.blocks, padded.blocks)
    torch.testing.assert_close(bt.dequantize(), w, atol=0.6 * float(w.abs().max()) / 7, rtol=0)


def test_llama_unpermute_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows, heads = 48, 3
    w = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    ref = LlamaTensorProcessor(
        config={"num_attention_heads": 6, "num_key_value_heads": heads}
    )._reverse_permute_weights(w, 6, heads)
    assert np.array_equal(w[llama_unpermute(rows, heads)], ref)


def test_gguf_names_of_the_native_modules():
    assert gguf_tensor_names("model.layers.3.self_attn.k_proj") == ("blk.3.attn_k.weight",)
    assert gguf_tensor_names("model.layers.12.mlp.down_proj") == ("blk.12.ffn_down.weight",)
    assert gguf_tensor_names("lm_head") == ("output.weight", "token_embd.weight")
    assert gguf_tensor_names("model.norm") == ()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A small GGUF file written by gguf's own writer: a string array in the metadata (skipped by our
    header reader), one tensor per block format, and a Llama q projection stored permuted."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "<s>"] * 50)
    writer.add_uint32("llama.attention.head_count", 4)
    weights = {}
    for i, fmt in enumerate(FMTS):
        w = _weight(24, 96, seed=i)
        weights[fmt] = w
        raw = quants.quantize(w.numpy(), FORMATS[fmt].ggml_type)
        writer.add_tensor(f"blk.0.t_{fmt}.weight", raw, raw_dtype=GGMLQuantizationType(FORMATS[fmt].ggml_type))
    q = _weight(32, 64, seed=9)  # 4 heads of 8: GGUF stores the rows permuted for ggml's RoPE
    permuted = q[np.argsort(llama_unpermute(32, 4))]
    raw = quants.quantize(permuted.numpy(), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    finish_gguf(writer)
    return path, weights, q


def test_blocks_read_from_a_file_dequantize_as_gguf_does(tiny_gguf):
    from gguf import GGUFReader, quants

    path, weights, _ = tiny_gguf
    ours = GGUFBlocks(str(path))
    assert ours.architecture == "llama"
    reader = {t.name: t for t in GGUFReader(str(path)).tensors}
    for fmt in FMTS:
        name = f"blk.0.t_{fmt}.weight"
        bt = ours.blocks(name)
        assert bt.format.name == fmt and (bt.rows, bt.cols) == (24, 96)
        assert np.array_equal(bt.blocks, reader[name].data)
        assert torch.equal(
            bt.dequantize(), torch.from_numpy(quants.dequantize(reader[name].data, reader[name].tensor_type))
        )
    assert ours.blocks("blk.0.attn_norm.weight") is None  # float32: not a block format
    assert ours.type_name("blk.0.attn_norm.weight") == "f32"


def test_matching_undoes_the_llama_row_permutation(tiny_gguf):
    path, _, q = tiny_gguf
    blocks = GGUFBlocks(str(path))
    expected = BlockTensor.quantize(q, "q8_0").dequantize()  # what transformers' loader would give the model
    found, why = blocks.matching("model.layers.0.self_attn.q_proj", expected, 4, 2)
    assert why == "" and torch.equal(found.dequantize(), expected)
    found, why = blocks.matching("model.layers.0.self_attn.q_proj", expected + 1e-3, 4, 2)
    assert found is None and "does not dequantize" in why
    found, why = blocks.matching("model.layers.0.self_attn.v_proj", expected, 4, 2)
    assert found is None and why == "not in the file"


# -- kernels ---------------------------------------------------------------


@needs_c
@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_activation_quantization_matches_the_reference(impl):
    x = block_acts(7, 100)
    x[1, :32] = torch.arange(32) * (4.0 / 127) * 0.5  # exact halves: ties round to even
    x[2, 40] = 1e30
    x[4, :64] *= 1e-38  # blocks whose scale's inverse is no finite float: q = 0 (AVX2 packed NaN as -128)
    x[5, 70] = float("nan")  # q = -127 there, the block's scale from the rest of it
    for ours, ref in zip(quant.quantize_rows(x, impl), quant.quantize_rows_reference(x)):
        assert torch.equal(ours, ref)
    assert int(quant.quantize_rows(x, impl)[0].min()) == -127  # never -128: the AVX2 sign trick needs it


SHAPES = [(1, 32), (13, 40), (8, 96), (37, 100), (24, 576)]


@needs_c
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernels_equal_the_reference_and_a_float_reference(fmt, n, k):
    w, x = _weight(n, k), block_acts(11, k)
    bias = torch.randn(n)
    bt = BlockTensor.quantize(w, fmt)
    ref = quant.block_linear_reference(x, [bt], bias)
    packed = quant.pack(bt)
    for impl in quant.supported_impls():
        assert torch.equal(quant.Projection([packed], bias, k, impl)(x), ref), impl
    # the same blocks in float64: only the float32 roundings of the block sums differ
    exact = _dequantized_acts(x) @ bt.dequantize().double().T + bias.double()
    scale = _dequantized_acts(x).abs() @ bt.dequantize().double().abs().T + 1
    assert ((ref.double() - exact).abs() <= 1e-6 * scale).all()


@needs_c
def test_a_projection_stacks_parts_in_different_formats():
    k = 64
    parts = [
        BlockTensor.quantize(_weight(n, k, seed=s), fmt)
        for s, (n, fmt) in enumerate([(16, "q4_1"), (5, "q8_0"), (11, "q4_0")])
    ]
    bias = torch.randn(32)
    x = block_acts(6, k)
    y = quant.Projection([quant.pack(p) for p in parts], bias, k)(x)
    assert torch.equal(y, quant.block_linear_reference(x, parts, bias))
    for i, p in enumerate(parts):
        lo = sum(q.rows for q in parts[:i])
        assert torch.equal(y[:, lo : lo + p.rows], quant.block_linear_reference(x, [p], bias[lo : lo + p.rows]))


@needs_c
@pytest.mark.parametrize("fmt", FMTS)
def test_rows_are_bitwise_invariant_to_row_count_and_threads(fmt):
    n, k = 45, 200  # an odd last group, a padded last block
    assert_rows_bitwise_invariant(BlockTensor.quantize(_weight(n, k), fmt), block_acts(16, k))


@needs_c
def test_a_prefill_sized_pass_gives_every_row_its_own_bits():
    bt = BlockTensor.quantize(_weight(40, 96), "q4_0")
    proj = quant.Projection([quant.pack(bt)], None, 96)
    x = block_acts(150, 96)  # more rows than one L2-sized row block (64)
    full = proj(x)
    assert torch.equal(full, quant.block_linear_reference(x, [bt]))
    for lo, hi in ((0, 1), (63, 65), (64, 128), (149, 150), (5, 100)):
        assert torch.equal(proj(x[lo:hi]), full[lo:hi]), (lo, hi)


def test_the_torch_reference_is_row_invariant():
    bt = BlockTensor.quantize(_weight(21, 72), "q4_1")
    x = block_acts(9, 72)
    full = quant.block_linear_reference(x, [bt])
    for m in range(1, 10):
        assert torch.equal(quant.block_linear_reference(x[m - 1 : m], [bt]), full[m - 1 : m])


@needs_c
def test_projection_checks_its_inputs():
    bt = quant.pack(BlockTensor.quantize(_weight(8, 64), "q8_0"))
    with pytest.raises(ValueError):
        quant.Projection([bt], None, 32)  # width mismatch
    with pytest.raises(ValueError):
        quant.Projection([bt], torch.zeros(7), 64)  # bias size
    with pytest.raises(ValueError):
        quant.Projection([bt], None, 64, impl="avx512")
    with pytest.raises(TypeError):
        quant.Projection([bt], None, 64)(torch.zeros(2, 64, dtype=torch.float64))


def test_the_ctypes_declarations_match_the_c_source():
    source = (Path(quant.__file__).with_name("quant.c")).read_text()
    kinds = {"int64_t": "i64", "float *": "ptr", "void *": "ptr", "fd_proj *": "ptr"}
    for name, (restype, args) in quant.C_FUNCTIONS.items():
        m = re.search(rf"^(\w+) {name}\(([^)]*)\)", source, re.M)
        assert m, name
        assert (m.group(1) == "void") == (restype is None), name
        c_args = [a.strip() for a in m.group(2).split(",")]
        assert [a.split()[-1].lstrip("*") for a in c_args] == [a for a, _ in args], name
        for c_arg, (_, ctype) in zip(c_args, args):
            kind = next(v for k, v in kinds.items() if k in c_arg.replace("const ", "") or c_arg.startswith(k))
            assert kind == ("i64" if ctype is quant._i64 else "ptr"), (name, c_arg)
    for struct, cls in (("fd_part", quant.CPart), ("fd_proj", quant.CProj)):
        body = re.search(r"typedef struct \{([^{}]*)\} " + struct + ";", source).group(1)
        fields = re.findall(r"(\w+)(?:\[\w+\])?;", re.sub(r"/\*.*?\*/", "", body, flags=re.S))
        assert fields == [f for f, _ in cls._fields_], struct
    assert f"#define FD_MAX_PARTS {quant.MAX_PARTS}" in source
    for fmt, code in quant.WEIGHT_FORMATS.items():
        assert f"#define FD_W_{fmt.upper()} {code}" in source
    assert QK == 32


@needs_c
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("k", [7 * QK, 18 * QK])  # an odd block count (the last pair padded), SmolLM2's width
def test_the_paired_layout_gives_the_reference_bits_at_1_3_8_rows(fmt, k):
    """Packed in units of two blocks, each its scales then its quants: the bits of the torch
    reference (the arithmetic the kernels always had) at 1, 3 and 8 rows, and each row of a pass
    the bits it gets alone."""
    n, nb = 21, -(-k // QK)
    bt = BlockTensor.quantize(_weight(n, k, seed=k), fmt)
    unit = (32 if fmt == "q4_1" else 16) * 2 + 2 * (256 if fmt == "q8_0" else 128)
    assert quant.pack(bt).data.numel() == -(-n // quant.GROUP) * -(-nb // 2) * unit
    x = block_acts(8, k, seed=k)
    for impl in quant.supported_impls():
        proj = quant.Projection([quant.pack(bt)], None, k, impl)
        for m in (1, 3, 8):
            y = proj(x[:m])
            assert torch.equal(y, quant.block_linear_reference(x[:m], [bt])), (impl, m)
            assert torch.equal(proj(x[m - 1 : m]), y[m - 1 :]), (impl, m)


@needs_c
def test_a_prepared_call_gives_the_projections_bits():
    bt = BlockTensor.quantize(_weight(20, 96), "q4_1")
    proj = quant.Projection([quant.pack(bt)], torch.randn(20), 96)
    x = block_acts(3, 96)
    run = proj.prepared(x)
    assert torch.equal(run(), proj(x)) and torch.equal(run(), proj(x))
    with pytest.raises(TypeError):
        proj.prepared(x.double())


def test_a_compiler_without_the_vnni_flags_or_attributes_builds_the_avx2_library(monkeypatch, tmp_path):
    """The first build (AVX-VNNI and AVX-512 VNNI kernels by function attributes) fails on an older
    compiler; the second leaves them out (-DFD_NO_VNNI)."""
    import subprocess

    from fastdecode.kernels import build

    calls = []

    def compile_(cc, flags, source, out):
        calls.append(flags)
        ok = "-DFD_NO_VNNI" in flags
        if ok:
            Path(out).write_bytes(b"library")
        return subprocess.CompletedProcess([cc], 0 if ok else 1, "", "" if ok else "unknown target")

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_compile", compile_)
    assert build.build(build.find_compiler() or "cc").read_bytes() == b"library"
    assert calls == [build.CFLAGS, build.CFLAGS + build.NO_VNNI_FLAGS]


def test_concurrent_builds_of_one_key_compile_it_once(monkeypatch, tmp_path):
    """Two callers at once (two test runs, a server and a test): the second waits for the first's
    build and takes its library."""
    import subprocess
    import threading
    import time

    from fastdecode.kernels import build

    calls, started = [], threading.Event()

    def compile_(cc, flags, source, out):
        calls.append(flags)
        started.set()
        time.sleep(0.5)  # the other caller arrives while this one compiles
        Path(out).write_bytes(b"library")
        return subprocess.CompletedProcess([cc], 0, "", "")

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_compile", compile_)
    cc = build.find_compiler() or "cc"
    first = []
    thread = threading.Thread(target=lambda: first.append(build.build(cc)))
    thread.start()
    assert started.wait(30)
    second = build.build(cc)
    thread.join()
    assert first == [second] and second.read_bytes() == b"library" and len(calls) == 1
