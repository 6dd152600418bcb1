import pytest
import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.quant import (
    GGUFBlockConfig,
    GGUFBlockLinear,
    GPTQConfig,
    Int4WeightOnlyConfig,
    Int4WeightOnlyLinear,
    Int8WeightOnlyConfig,
    Int8WeightOnlyLinear,
    config_from_method,
    default_calibration_text,
    model_weight_bytes,
    quantize_,
    quantized_layers,
    register_quant_method,
)
from fastdecode.quant.api import QUANT_HANDLERS

DECODER_LINEARS = 2 * 7  # q, k, v, o, gate, up, down per layer


def _rel(a, b):
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def _count(model, cls):
    return sum(isinstance(m, cls) for m in model.modules())


def test_int8_replaces_decoder_linears_and_keeps_the_head_float(quant_llama, probe_ids, run_logits):
    reference = run_logits(quant_llama, probe_ids)
    quantize_(quant_llama, Int8WeightOnlyConfig())
    assert _count(quant_llama, Int8WeightOnlyLinear) == DECODER_LINEARS
    assert type(quant_llama.lm_head) is nn.Linear
    assert _count(quant_llama, nn.Linear) == 1
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.02


def test_int4_with_empty_skip_quantizes_the_head_too(quant_llama, probe_ids, run_logits):
    reference = run_logits(quant_llama, probe_ids)
    quantize_(quant_llama, Int4WeightOnlyConfig(group_size=32), skip=())
    assert _count(quant_llama, Int4WeightOnlyLinear) == DECODER_LINEARS + 1
    assert _count(quant_llama, nn.Linear) == 0
    # Random init weights are a worst case for 4 bits (no outlier structure to exploit).
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.25


def test_skip_patterns_match_names_and_globs(quant_llama):
    quantize_(quant_llama, Int8WeightOnlyConfig(), skip=("lm_head", "model.layers.1.*", "down_proj"))
    names = set(quantized_layers(quant_llama))
    assert names == {
        f"model.layers.0.{p}"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    }


def test_int4_falls_back_to_a_group_size_that_divides(quant_llama):
    with pytest.warns(UserWarning, match="group size 128"):
        quantize_(quant_llama, Int4WeightOnlyConfig(group_size=128))
    layers = quantized_layers(quant_llama)
    assert layers["model.layers.0.mlp.down_proj"]["group_size"] == 128  # in_features 128
    assert layers["model.layers.0.self_attn.q_proj"]["group_size"] == 64  # in_features 64


def test_layers_the_kernels_cannot_run_are_named_in_the_error():
    model = nn.Sequential(nn.Linear(40, 64), nn.Linear(64, 40))
    with pytest.raises(ConfigError, match=r"^0: .*in_features"):
        quantize_(model, Int8WeightOnlyConfig())
    with pytest.raises(ConfigError, match="int4 cannot quantize 0 "):
        quantize_(nn.Sequential(nn.Linear(64, 40)), Int4WeightOnlyConfig())  # out_features % 16


def test_gptq_quantizes_from_token_ids(quant_llama, probe_ids, calibration_ids, run_logits):
    reference = run_logits(quant_llama, probe_ids)
    quantize_(quant_llama, GPTQConfig(bits=4, group_size=32, calibration_token_ids=calibration_ids))
    assert _count(quant_llama, Int4WeightOnlyLinear) == DECODER_LINEARS
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.25


def test_gptq_int8(quant_llama, probe_ids, calibration_ids, run_logits):
    reference = run_logits(quant_llama, probe_ids)
    quantize_(quant_llama, config_from_method("int8-gptq", calibration_token_ids=calibration_ids))
    assert _count(quant_llama, Int8WeightOnlyLinear) == DECODER_LINEARS
    assert _rel(run_logits(quant_llama, probe_ids), reference) < 0.02


def test_gptq_calibrates_on_text_with_a_tokenizer(quant_llama, tokenizer):
    text = "The quick brown fox jumps over the lazy dog; def f(x): return x * 2. " * 8
    config = GPTQConfig(calibration_texts=[text], num_samples=3, seq_len=64)
    quantize_(quant_llama, config, tokenizer=tokenizer)
    assert _count(quant_llama, Int4WeightOnlyLinear) == DECODER_LINEARS


def test_gptq_on_text_needs_a_tokenizer(quant_llama):
    with pytest.raises(ConfigError, match="tokenizer"):
        quantize_(quant_llama, GPTQConfig())


def test_default_calibration_text_is_a_few_kilobytes_of_prose_and_code():
    text = default_calibration_text()
    assert 3000 < len(text) < 20000
    assert "def " in text or "return" in text


def _linear_bytes(model):
    return sum(
        m.weight.numel() * m.weight.element_size() if isinstance(m, nn.Linear) else m.weight_bytes()
        for m in model.modules()
        if isinstance(m, (nn.Linear, Int8WeightOnlyLinear, Int4WeightOnlyLinear))
    )


def test_weight_bytes_shrink(build_llama):
    models = {
        "float": build_llama(),
        "int8": quantize_(build_llama(), Int8WeightOnlyConfig(), skip=()),
        "int4": quantize_(build_llama(), Int4WeightOnlyConfig(group_size=32), skip=()),
    }
    linear = {k: _linear_bytes(m) for k, m in models.items()}
    # 1 B/weight + a bf16 scale per row: 4 / (1 + 2/64) = 3.88 for in_features 64.
    assert linear["float"] / linear["int8"] > 3.8
    assert linear["float"] / linear["int4"] > 6.3  # 0.5 B/weight + bf16 scale and zero per 32
    # The whole model shrinks less: embeddings and norms stay float.
    whole = {k: model_weight_bytes(m) for k, m in models.items()}
    assert whole["float"] > whole["int8"] > whole["int4"]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_gguf_blocks_replace_decoder_linears_and_keep_the_head_float(fmt, quant_llama, probe_ids, run_logits):
    from fastdecode.kernels.gguf_blocks import BlockTensor

    reference = run_logits(quant_llama, probe_ids)
    q_proj = quant_llama.model.layers[0].self_attn.q_proj.weight.detach().clone()
    quantize_(quant_llama, GGUFBlockConfig(fmt))
    assert _count(quant_llama, GGUFBlockLinear) == DECODER_LINEARS
    assert type(quant_llama.lm_head) is nn.Linear
    layer = quant_llama.model.layers[0].self_attn.q_proj
    assert (layer.blocks.numpy() == BlockTensor.quantize(q_proj, fmt).blocks).all()  # ggml's rounding
    assert quantized_layers(quant_llama)["model.layers.0.mlp.down_proj"] == {
        "kind": "gguf_block",
        "format": fmt,
        "shape": [64, 128],
    }
    assert _rel(run_logits(quant_llama, probe_ids), reference) < (0.02 if fmt == "q8_0" else 0.25)


def test_gguf_blocks_with_empty_skip_quantize_a_tied_head_and_keep_the_embeddings(build_llama):
    model = build_llama(tie_word_embeddings=True)
    embeddings = model.model.embed_tokens.weight.detach().clone()
    quantize_(model, GGUFBlockConfig("q4_1"), skip=())
    assert isinstance(model.lm_head, GGUFBlockLinear) and _count(model, nn.Linear) == 0
    assert torch.equal(model.model.embed_tokens.weight, embeddings)


def test_config_from_method():
    for fmt in ("q8_0", "q4_0", "q4_1"):
        assert config_from_method(fmt) == GGUFBlockConfig(fmt)
        assert config_from_method(fmt).to_dict() == {"method": fmt}
    assert config_from_method("int8") == Int8WeightOnlyConfig()
    assert config_from_method("int4") == Int4WeightOnlyConfig(group_size=32)
    assert config_from_method("int4", group_size=128) == Int4WeightOnlyConfig(group_size=128)
    assert config_from_method("int4-gptq", group_size=64, num_samples=2) == GPTQConfig(
        bits=4, group_size=64, num_samples=2
    )
    assert config_from_method("int8-gptq").method == "int8-gptq"


@pytest.mark.parametrize(
    "call",
    [
        lambda: config_from_method("int3"),
        lambda: config_from_method("fp8"),
        lambda: config_from_method("int4", group_size=48),
        lambda: config_from_method("int4", group_size=16),
        lambda: config_from_method("int8", group_size=32),
        lambda: config_from_method("int4", num_samples=4),
        lambda: config_from_method("q4_0", group_size=32),
        lambda: config_from_method("q4_k"),
        lambda: GGUFBlockConfig("q5_0"),
        lambda: Int4WeightOnlyConfig(group_size=100),
        lambda: GPTQConfig(bits=3),
        lambda: GPTQConfig(bits=8),  # int8 is per-channel: group_size must be None
        lambda: GPTQConfig(num_samples=0),
        lambda: GPTQConfig(percdamp=-0.1),
        lambda: GPTQConfig(calibration_token_ids=[[]]),
    ],
)
def test_bad_settings_raise_config_error(call):
    with pytest.raises(ConfigError):
        call()


def test_unregistered_config_raises_config_error(quant_llama):
    with pytest.raises(
        ConfigError,
        match="unknown quantization config 'object'; choose from: AWQConfig, GGUFBlockConfig, GPTQConfig, Int4",
    ):
        quantize_(quant_llama, object())


def test_a_new_method_is_one_config_plus_one_handler(quant_llama):
    class HalfConfig:
        pass

    seen = {}

    @register_quant_method(HalfConfig)
    def _handler(model, targets, config, tokenizer):
        seen.update(targets)

    try:
        quantize_(quant_llama, HalfConfig(), skip=())
    finally:
        QUANT_HANDLERS.unregister(HalfConfig)
    assert "lm_head" in seen and len(seen) == DECODER_LINEARS + 1
