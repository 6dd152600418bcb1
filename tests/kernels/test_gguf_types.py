"""Every GGUF tensor type fastdecode runs (fastdecode.kernels.gguf_types, fastdecode.kernels.gguf_blocks.file_blocks):
its blocks unpack to gguf-py's values bit for bit, and the table says how each runs and what it costs."""

import numpy as np
import pytest
import torch
from gguf_files import finish_gguf, random_raw

from fastdecode.formats.gguf_match import GGUFBlocks
from fastdecode.kernels.gguf_blocks import file_blocks
from fastdecode.kernels.gguf_types import BLOCK_FORMATS, GGUF_TYPES, QK, gguf_type, row_bytes

TYPES = [t.format.name for t in GGUF_TYPES.values()]
BLOCK_TYPES = [n for n in TYPES if not BLOCK_FORMATS[n].is_float]
ISSUE_TYPES = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"}


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.int32)


def test_the_table_covers_the_common_types_with_ggufs_sizes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert ISSUE_TYPES | {"iq4_nl", "iq4_xs", "mxfp4"} == set(TYPES)
    for ggml_type, entry in GGUF_TYPES.items():
        f = entry.format
        assert GGMLQuantizationType(ggml_type).name.lower() == f.name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] == (f.block_weights, f.block_bytes)
        assert entry.file_bytes_per_weight == f.block_bytes / f.block_weights
        # packed: the file's bytes up to the padding of a super-block's scales
        assert entry.file_bytes_per_weight <= entry.packed_bytes_per_weight <= 1.06 * entry.file_bytes_per_weight
        assert entry.route == "native"


@pytest.mark.parametrize("name", TYPES)
def test_every_type_unpacks_bit_for_bit_as_gguf_dequantizes(name):
    from gguf import quants

    f = BLOCK_FORMATS[name]
    cols = 3 * 256
    raw = random_raw(name, 37, cols, seed=len(name))
    assert raw.shape == (37, row_bytes(f.ggml_type, cols))
    bt = file_blocks(f.ggml_type, raw, cols)
    assert bt.format is f and (bt.rows, bt.cols) == (37, cols)
    ours = bt.dequantize()
    assert ours.dtype == torch.float32 and ours.shape == (37, cols)
    assert np.array_equal(_bits(ours), _bits(quants.dequantize(raw, f.ggml_type)))  # zeros' signs too


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_fields_are_blocks_of_32_whose_values_are_the_weights(name):
    """d * (q - offset) (+ m) per block of 32 from fields() alone is dequantize()'s weight."""
    f = BLOCK_FORMATS[name]
    bt = file_blocks(f.ggml_type, random_raw(name, 5, 512, seed=1), 512)
    q, d, m = bt.fields()
    s = f.scales_per_block
    assert q.shape == (5, 16, QK) and d.shape == (5, 16, s)
    assert q.dtype in (np.int8, np.uint8) and (m is None) == (not f.has_min)
    w = bt.dequantize().view(5, 16, s, QK // s)
    for b in (0, 9):
        for h in range(s):
            qf = q[2, b, h * QK // s : (h + 1) * QK // s].astype(np.float32) - np.float32(f.q_offset)
            expected = np.float32(d[2, b, h]) * qf
            if m is not None:
                expected = expected + np.float32(m[2, b, h] if m.ndim == 3 else m[2, b])
            assert np.array_equal(_bits(w[2, b, h]), _bits(expected)), (b, h)


def test_the_integers_stay_in_each_types_range():
    ranges = {"q2_k": (0, 3), "q3_k": (-4, 3), "q5_0": (0, 31), "q5_1": (0, 31), "q5_k": (0, 31), "q6_k": (-32, 31)}
    for name, (lo, hi) in ranges.items():
        f = BLOCK_FORMATS[name]
        q, _, _ = file_blocks(f.ggml_type, random_raw(name, 16, 256, seed=2), 256).fields()
        assert (q.min(), q.max()) == (lo, hi), name  # 4096 random weights reach both ends
    for name in ("iq4_nl", "iq4_xs"):
        f = BLOCK_FORMATS[name]
        q, _, _ = file_blocks(f.ggml_type, random_raw(name, 16, 256, seed=2), 256).fields()
        assert set(np.unique(q)) == {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
    q, _, _ = file_blocks(39, random_raw("mxfp4", 16, 256, seed=2), 256).fields()
    assert set(np.unique(q)) == {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12}  # E2M1's values doubled


def test_every_e8m0_scale_unpacks_bit_for_bit():
    """MXFP4's 256 scale bytes, each over all 16 codes: 2^(e - 128), subnormal at e = 0 and 1, and
    12 * 2^127 overflowing to inf as ggml's own product does."""
    from gguf import quants

    b = np.zeros((256, 1, 17), np.uint8)
    b[:, 0, 0] = np.arange(256)
    b[:, 0, 1:] = np.arange(16, dtype=np.uint8) * 17  # byte i: codes i and i (weights i and 16 + i)
    raw = b.reshape(256, 17)
    ours = file_blocks(39, raw, 32).dequantize()
    with np.errstate(over="ignore"):  # gguf-py's float32 product overflows where ggml's does
        theirs = quants.dequantize(raw, 39)
    assert np.array_equal(_bits(ours), _bits(theirs))
    assert ours[128, 7] == 12 and ours[0, 1] == 2.0**-128 and torch.isinf(ours[255, 7])


def test_refusals_name_the_type_or_the_shape():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        gguf_type(16)
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        file_blocks(16, np.zeros((1, 66), np.uint8), 256)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes(12, 200)
    with pytest.raises(ValueError, match="rows of 144 bytes"):
        file_blocks(12, np.zeros((2, 145), np.uint8), 256)
    with pytest.raises(ValueError, match="float weights"):
        file_blocks(1, np.zeros((2, 64), np.uint8), 32).fields()


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory):
    """A GGUF file written by gguf's own writer holding one tensor of every type fastdecode runs."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    raws = {}
    for i, name in enumerate(TYPES):
        f = BLOCK_FORMATS[name]
        raws[name] = random_raw(name, 24, 512, seed=i)
        data = raws[name]
        if f.is_float:  # the writer takes float tensors by their numpy dtype
            data = data.view({"f32": np.float32, "f16": np.float16, "bf16": np.uint8}[name])
        writer.add_tensor(f"blk.0.t_{name}.weight", data, raw_dtype=GGMLQuantizationType(f.ggml_type))
    finish_gguf(writer)
    return path, raws


def test_a_files_tensors_of_every_type_are_read_as_stored(every_type_gguf):
    from gguf import GGUFReader, quants

    path, raws = every_type_gguf
    file = GGUFBlocks(str(path))
    reader = {t.name: t for t in GGUFReader(str(path)).tensors}
    for name in TYPES:
        tensor = reader[f"blk.0.t_{name}.weight"]
        raw = np.asarray(tensor.data).reshape(24, -1).view(np.uint8)
        assert np.array_equal(raw, raws[name]), name
        bt = file_blocks(int(tensor.tensor_type), raw, 512)
        assert np.array_equal(_bits(bt.dequantize()), _bits(quants.dequantize(raw, tensor.tensor_type)))
        from_file = file.blocks(f"blk.0.t_{name}.weight")
        if BLOCK_FORMATS[name].is_float:  # the float path's: not the block kernels'
            assert from_file is None
        else:
            assert from_file.format.name == name and np.array_equal(from_file.blocks, raws[name])
