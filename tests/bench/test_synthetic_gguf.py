"""Random-weight GGUF files at real model shapes (fastdecode.bench.synthetic_gguf)."""

import numpy as np
import pytest

from fastdecode.bench.synthetic_gguf import (
    SHAPES,
    SINGLE_TYPES,
    random_weight,
    synthetic_gguf,
    use_more_bits,
    weight_types,
    write_synthetic_gguf,
)
from fastdecode.errors import ConfigError
from fastdecode.formats.gguf_export import DecoderShape, llama3_rope_factors

BLOCK_TYPES = [t for t in SINGLE_TYPES if t not in ("f16", "bf16")]
FP16_SCALED = [t for t in BLOCK_TYPES if t != "mxfp4"]  # MXFP4's scale is an E8M0 byte


def _dequantize(qtype: str, data: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if qtype == "f16":
        return data.view(np.float16).astype(np.float32)
    if qtype == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return quants.dequantize(data, GGMLQuantizationType[qtype.upper()])


def test_q4_k_m_gives_q6_k_where_llama_cpp_does():
    # Llama-3.1-8B-Q4_K_M: ffn_down and attn_v in Q6_K on 16 of 32 layers (0-3, 28-31 and every
    # third between), the output in Q6_K, the untied token embedding in the base Q4_K.
    types = weight_types(SHAPES["llama-3.1-8b"], "q4_k_m")
    bumped = [i for i in range(32) if types[f"blk.{i}.ffn_down.weight"] == "q6_k"]
    assert bumped == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert bumped == [i for i in range(32) if types[f"blk.{i}.attn_v.weight"] == "q6_k"]
    assert types["output.weight"] == "q6_k" and types["token_embd.weight"] == "q4_k"
    assert {types[f"blk.{i}.{t}.weight"] for i in range(32) for t in ("attn_q", "attn_k", "ffn_up")} == {"q4_k"}
    # Tied (Llama-3.2-1B): the token embedding is the output, so it takes the output's Q6_K.
    assert weight_types(SHAPES["llama-3.2-1b"], "q4_k_m")["token_embd.weight"] == "q6_k"
    assert "output.weight" not in weight_types(SHAPES["llama-3.2-1b"], "q4_k_m")
    # A single type is pure: every weight in it.
    assert set(weight_types(SHAPES["qwen3-4b"], "q8_0").values()) == {"q8_0"}
    assert [use_more_bits(i, 16) for i in range(16)].count(True) == 8


@pytest.mark.parametrize("qtype", SINGLE_TYPES)
def test_random_weights_are_finite_of_a_sane_size_and_deterministic(qtype):
    rows, cols = 16, 1024
    w = random_weight(qtype, rows, cols, np.random.default_rng(3))
    values = _dequantize(qtype, w).reshape(rows, cols)
    assert np.isfinite(values).all()
    assert 0.5 / np.sqrt(cols) < values.std() < 2.0 / np.sqrt(cols)
    assert np.array_equal(w, random_weight(qtype, rows, cols, np.random.default_rng(3)))
    assert not np.array_equal(w, random_weight(qtype, rows, cols, np.random.default_rng(4)))


@pytest.mark.parametrize("qtype", FP16_SCALED)
def test_every_fp16_scale_is_a_normal_number(qtype):
    from fastdecode.bench.synthetic_gguf import _LAYOUTS

    w = random_weight(qtype, 4, 14336, np.random.default_rng(0))  # Llama-3.1-8B's ffn_down rows
    d_at, min_field, _ = _LAYOUTS[qtype]
    blocks = w.reshape(-1, w.shape[1] // (14336 // (256 if "_k" in qtype or qtype == "iq4_xs" else 32)))
    for at in (d_at,) + ((min_field[0],) if min_field else ()):
        d = np.abs(blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32))
        assert np.isfinite(d).all() and (d >= 2.0**-14).all() and (d < 1.0).all()


def test_mxfp4_scales_are_the_power_of_two_nearest_the_size_asked():
    from fastdecode.bench.synthetic_gguf import _unit_rms

    w = random_weight("mxfp4", 4, 14336, np.random.default_rng(0))
    e = w.reshape(-1, 17)[:, 0].astype(int)  # every block's E8M0 byte: d = 2^(e - 128)
    assert (e == 128 + round(np.log2(1 / np.sqrt(14336) / _unit_rms("mxfp4")))).all()
    assert 100 < e[0] < 128  # far from E8M0's subnormal and overflowing ends


def test_a_file_has_the_shape_metadata_tokenizer_and_types(tmp_path):
    from gguf import GGUFReader

    shape = SHAPES["tiny-llama"]
    path = write_synthetic_gguf(tmp_path / "t.gguf", "tiny-llama", "q4_k_m", seed=1)
    reader = GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == shape.num_layers and field("llama.embedding_length") == shape.hidden_size
    assert field("llama.attention.head_count_kv") == shape.num_kv_heads
    assert field("llama.feed_forward_length") == shape.intermediate_size
    assert field("general.file_type") == 15  # LlamaFileType.MOSTLY_Q4_K_M
    assert len(field("tokenizer.ggml.tokens")) == 49152 and field("tokenizer.ggml.model") == "gpt2"
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["token_embd.weight"].tensor_type.name == "Q6_K"  # tied: the output's type
    assert [tensors[f"blk.{i}.ffn_down.weight"].tensor_type.name for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert tensors["blk.3.attn_q.weight"].tensor_type.name == "Q4_K"
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [shape.intermediate_size, shape.hidden_size]
    assert np.array_equal(tensors["blk.0.attn_norm.weight"].data, np.ones(shape.hidden_size, np.float32))
    assert "output.weight" not in tensors and len(tensors) == 2 + 9 * shape.num_layers


def test_the_cache_writes_each_file_once(tmp_path):
    first = synthetic_gguf("tiny-llama", "q8_0", tmp_path)
    stamp = first.stat().st_mtime_ns
    again = synthetic_gguf("tiny-llama", "q8_0", tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama-q8_0-seed0.gguf"]


def test_same_seed_same_bytes(tmp_path):
    a = write_synthetic_gguf(tmp_path / "a.gguf", "tiny-llama", "iq4_xs", seed=5)
    b = write_synthetic_gguf(tmp_path / "b.gguf", "tiny-llama", "iq4_xs", seed=5)
    assert a.read_bytes() == b.read_bytes()


def test_unknown_names_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown type 'q4_k_x'"):
        write_synthetic_gguf(tmp_path / "x.gguf", "tiny-llama", "q4_k_x")
    with pytest.raises(ConfigError, match="unknown shape 'llama-9b'"):
        write_synthetic_gguf(tmp_path / "x.gguf", "llama-9b", "q8_0")


def test_llama3_rope_factors_match_transformers():
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = SHAPES["llama-3.2-1b"]
    rope = {"rope_type": "llama3", "rope_theta": shape.rope_theta, **shape.llama3_rope}
    config = LlamaConfig(
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        head_dim=shape.head_dim,
        rope_theta=shape.rope_theta,
        rope_scaling=rope,
        max_position_embeddings=shape.context_length,
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    plain = 1.0 / (shape.rope_theta ** (np.arange(0, shape.head_dim, 2) / shape.head_dim))
    np.testing.assert_allclose(plain / inv_freq.double().numpy(), llama3_rope_factors(shape), rtol=1e-5)


def test_params_of_the_real_shapes():
    # The trunks without the original vocabularies (49,152 tokens here instead of 128,256 / 151,936).
    billions = {name: SHAPES[name].num_params / 1e9 for name in ("llama-3.2-1b", "llama-3.1-8b", "qwen3-4b")}
    assert 1.0 < billions["llama-3.2-1b"] < 1.2 and 7.0 < billions["llama-3.1-8b"] < 7.5
    assert 3.6 < billions["qwen3-4b"] < 4.0
    assert isinstance(SHAPES["qwen3-4b"], DecoderShape) and SHAPES["qwen3-4b"].qk_norm


def test_the_mixture_of_experts_shapes():
    """OLMoE-1B-7B and Qwen3-30B-A3B as planned (never written here: 4-17 GB): their sizes, 3-D experts,
    float32 routers, OLMoE's query and key norms over the projections, llama.cpp's bump of ffn_down_exps."""
    from fastdecode.bench.synthetic_gguf import _plans

    assert 6.8 < SHAPES["olmoe-1b-7b"].num_params / 1e9 < 7.0  # 6.9B with OLMoE's own 50,304 tokens
    assert 29.8 < SHAPES["qwen3-30b-a3b"].num_params / 1e9 < 30.3  # 30.5B with Qwen3's 151,936
    olmoe = {t.name: t for t in _plans(SHAPES["olmoe-1b-7b"], "q4_k_m", 0)}
    assert olmoe["blk.0.attn_q_norm.weight"].shape == (2048,) and olmoe["blk.0.attn_k_norm.weight"].shape == (2048,)
    assert olmoe["blk.0.ffn_gate_exps.weight"].shape == (64, 1024, 2048)
    assert olmoe["blk.0.ffn_down_exps.weight"].shape == (64, 2048, 1024)
    assert olmoe["blk.0.ffn_gate_inp.weight"].shape == (64, 2048) and olmoe["blk.0.ffn_gate_inp.weight"].ggml_type == 0
    qwen = {t.name: t for t in _plans(SHAPES["qwen3-30b-a3b"], "q4_k_m", 0)}
    assert qwen["blk.47.ffn_up_exps.weight"].shape == (128, 768, 2048)
    assert qwen["blk.0.attn_q_norm.weight"].shape == (128,)
    types = weight_types(SHAPES["qwen3-30b-a3b"], "q4_k_m")  # use_more_bits: layers 0-5, 8, 11 ... of 48
    assert types["blk.0.ffn_down_exps.weight"] == "q6_k" and types["blk.7.ffn_down_exps.weight"] == "q4_k"
    assert types["blk.0.ffn_gate_exps.weight"] == "q4_k"


def test_a_tiny_mixture_of_experts_file_decodes_and_speculates(tmp_path):
    import fastdecode
    from fastdecode.loaders.gguf_model import is_lazy
    from fastdecode.loading import load_model

    path = write_synthetic_gguf(tmp_path / "m.gguf", "tiny-qwen3-moe", "q4_k_m")
    lazy, tokenizer = load_model(str(path), lazy=True)
    assert lazy.config.model_type == "qwen3_moe" and lazy.config.num_experts == 8
    assert lazy.config.moe_intermediate_size == 256 and lazy.config.norm_topk_prob
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None, weights="gguf")
    tokens = plain.generate("Hello there, how are", max_new_tokens=12, min_tokens=12).token_ids
    assert is_lazy(lazy) and len(tokens) == 12
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram", weights="gguf")
    assert ngram.generate("Hello there, how are", max_new_tokens=12, min_tokens=12).token_ids == tokens


def test_gpt_oss_shapes_and_a_tiny_mxfp4_file_that_speculates(tmp_path):
    """gpt-oss-20b as planned (never written here: ~12 GB in mxfp4): its size, its float32 biases and sinks,
    the FFN norm named post_attention_norm; a tiny gpt-oss in MXFP4 loads natively, each layer with its
    sinks and window, and n-gram speculation gives plain decoding's tokens."""
    import fastdecode
    from fastdecode.backends import make_target
    from fastdecode.bench.synthetic_gguf import _plans
    from fastdecode.loading import load_model

    assert 19.9 < SHAPES["gpt-oss-20b"].num_params / 1e9 < 20.1  # 20.9B with gpt-oss's own 201,088 tokens
    plans = {t.name: t for t in _plans(SHAPES["gpt-oss-20b"], "mxfp4", 0)}
    assert plans["blk.0.ffn_gate_exps.weight"].shape == (32, 2880, 2880)
    assert plans["blk.0.ffn_down_exps.bias"].shape == (32, 2880) and plans["blk.0.attn_sinks.weight"].shape == (64,)
    assert plans["blk.23.post_attention_norm.weight"].ggml_type == 0 and plans["blk.0.attn_q.bias"].ggml_type == 0
    path = write_synthetic_gguf(tmp_path / "m.gguf", "tiny-gpt-oss", "mxfp4")
    lazy, tokenizer = load_model(str(path), lazy=True)
    assert lazy.config.model_type == "gpt_oss" and lazy.config.rope_parameters["rope_type"] == "yarn"
    target = make_target(lazy, "native")
    assert target.weights == "gguf:mxfp4" and [layer.window for layer in target.layers] == [128, None] * 2
    plain = fastdecode.accelerate(lazy, tokenizer, drafter=None)
    tokens = plain.generate("Hello there, how are", max_new_tokens=12, min_tokens=12).token_ids
    ngram = fastdecode.accelerate(lazy, tokenizer, drafter="ngram")
    assert ngram.generate("Hello there, how are", max_new_tokens=12, min_tokens=12).token_ids == tokens
