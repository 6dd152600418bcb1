"""A GGUF file's Q5_0 tensors run on the block kernels as stored: five-bit quants, the file's weights exactly."""

import numpy as np
import pytest
import torch
from gguf_files import finish_gguf

from fastdecode.formats.gguf_match import GGUFBlocks
from fastdecode.kernels.gguf_blocks import QK, file_blocks

Q5_0_TYPE, Q5_0_BLOCK_BYTES = 6, 22  # gguf.GGMLQuantizationType.Q5_0: fp16 d, qh[4], qs[16]


def q5_0(raw: np.ndarray, cols: int):
    return file_blocks(Q5_0_TYPE, raw, cols)


def random_q5_0(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q5_0 bytes (every quant and fifth-bit pattern is valid) with finite fp16 d, some +-0."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // QK, Q5_0_BLOCK_BYTES), dtype=np.uint8)
    d = (rng.standard_normal(b.shape[:2]) * 1e-2).astype(np.float16)
    d.flat[::5] = 0.0
    d.flat[2::9] = -0.0
    b[..., 0:2] = d[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def _bits(t):
    return np.ascontiguousarray(np.asarray(t, dtype=np.float32)).view(np.int32)


def test_q5_0_keeps_its_blocks_and_dequantizes_bit_for_bit():
    from gguf import GGMLQuantizationType, quants

    raw = random_q5_0(9, 5 * QK)
    bt = q5_0(raw, 5 * QK)
    assert bt.format.name == "q5_0" and (bt.rows, bt.cols) == (9, 160) and bt.blocks is raw
    q, d, _ = bt.fields()
    assert q.min() >= 0 and q.max() <= 31 and bt.format.q_offset == 16  # five bits; weight = d * (q - 16)
    assert np.array_equal(_bits(bt.dequantize()), _bits(quants.dequantize(raw, GGMLQuantizationType.Q5_0)))


def test_a_files_q5_0_tensor_is_read_matched_and_named(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    from fastdecode.backends.linear import BlockWeights

    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(str(path), "llama")
    raw = random_q5_0(16, 2 * QK, seed=3)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=GGMLQuantizationType.Q5_0)
    finish_gguf(writer)
    file = GGUFBlocks(str(path))
    assert file.type_name("blk.0.ffn_up.weight") == "q5_0"
    weight = q5_0(raw, 2 * QK).dequantize()
    found, why = file.matching("model.layers.0.mlp.up_proj", weight, 4, 2)
    assert why == "" and found.format.name == "q5_0" and torch.equal(found.dequantize(), weight)

    class Config:
        fastdecode_gguf_file = str(path)
        num_attention_heads, num_key_value_heads = 4, 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.up_proj = torch.nn.Linear(2 * QK, 16, bias=False)
            self.up_proj.weight.data = weight.clone()

    model = Model()
    named = dict(model.named_modules())
    blocks = BlockWeights(model, "gguf")
    blocks._names = {id(named["up_proj"]): "model.layers.0.mlp.up_proj"}
    linear = blocks([model.up_proj], None)
    assert blocks.weights == "gguf:q5_0" and blocks.note is None
    x = torch.randn(3, 2 * QK)
    torch.testing.assert_close(linear(x), x @ weight.T, rtol=0.05, atol=0.05)  # 8-bit activations


@pytest.mark.parametrize("cols", [QK, 3 * QK])
def test_q5_0_fifth_bits_land_on_the_right_weights(cols):
    raw = np.zeros((1, cols // QK * Q5_0_BLOCK_BYTES), np.uint8)
    raw[0, 0:2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1 in the first block
    raw[0, 2:6] = np.array([(1 << 3) | (1 << (16 + 5))], "<u4").view(np.uint8)  # fifth bits of weights 3 and 16 + 5
    w = q5_0(raw, cols).dequantize()[0, :QK]
    expected = torch.full((QK,), -16.0)
    expected[3], expected[21] = 0.0, 0.0  # 16 - 16
    assert torch.equal(w, expected)
