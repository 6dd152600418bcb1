"""Quantized checkpoints other tools write (compressed-tensors, AutoAWQ, GPTQ) loaded onto the
block kernels: each layer holds the checkpoint's own integers (its dequantized values equal the
reference's), and the logits stay within tolerance of the reference dequantized float model on
the native backend and on transformers; variants no kernel holds get one clear error."""

import copy
import json

import pytest
import torch
from checkpoint_files import AWQ_ORDER_MAP, quantized_linears, write_awq, write_compressed_tensors, write_gptq
from safetensors.torch import load_file
from tiny_models import KERNEL_FRIENDLY, tiny_llama, word_tokenizer

from fastdecode.backends import PagedSequence, make_target
from fastdecode.errors import ConfigError
from fastdecode.formats.checkpoints import load_checkpoint
from fastdecode.kernels.w8a8 import quantize_tokens_reference
from fastdecode.loading import load_model, resolve_spec
from fastdecode.quant.linear import GGUFBlockLinear, W8A8Linear

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]
# The block kernels quantize each row of activations to int8 per block of 32 (ggml's numeric
# model), so logits differ from the float reference by that rounding: measured at most ~1.2%
# of the largest logit on this model; 3% leaves room for other seeds and CPUs.
LOGIT_TOLERANCE = 0.03
# q4_1's minimum m = -scale * zero rounded to fp16 moves a weight by at most 2^-11 |m| <= 2^-7 scale.
MIN_ROUNDING = 2.0**-7


@pytest.fixture(scope="module")
def float_model():
    return tiny_llama(0, **KERNEL_FRIENDLY)


def with_weights(model, weights: dict):
    """A copy of ``model`` whose layers hold ``weights`` (the reference dequantized model)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in weights.items():
            ref.get_submodule(name).weight.copy_(w)
    return ref


def assert_logits_close(loaded, reference):
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([PROMPT])).logits[0]
        hf = loaded(input_ids=torch.tensor([PROMPT])).logits[0]
    native = PagedSequence(make_target(loaded, "native")).forward(PROMPT, len(PROMPT))
    scale = want.abs().max()
    assert (hf - want).abs().max() < LOGIT_TOLERANCE * scale
    assert (native - want).abs().max() < LOGIT_TOLERANCE * scale
    assert (native.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def assert_layers(loaded, reference: dict, fmt: str, exact: bool = True):
    for name, w in reference.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, GGUFBlockLinear) and layer.format == fmt, name
        if exact:
            assert torch.equal(layer.dequantize(), w), name
        else:
            scale = w.abs().amax(1, keepdim=True) / 7  # about one quantization step
            assert ((layer.dequantize() - w).abs() <= MIN_ROUNDING * scale + 1e-12).all(), name


# ---------------------------------------------------------------- AutoAWQ


def test_the_awq_writer_follows_autoawq_gemm_layout(float_model, tmp_path):
    """Field by field, as WQLinear_GEMM stores them; unpacked the way AutoAWQ's own
    dequantize_gemm does (shifts 0, 4, ..., 28, then the reverse order [0, 4, 1, 5, 2, 6, 3, 7])."""
    reference = write_awq(tmp_path, float_model, group=32)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert state[f"{name}.qweight"].dtype == torch.int32 and state[f"{name}.qweight"].shape == (128, 8)
    assert state[f"{name}.qzeros"].dtype == torch.int32 and state[f"{name}.qzeros"].shape == (4, 8)
    assert state[f"{name}.scales"].dtype == torch.float16 and state[f"{name}.scales"].shape == (4, 64)
    assert f"{name}.weight" not in state and "lm_head.weight" in state
    shifts = torch.arange(0, 32, 4)
    nibbles = (state[f"{name}.qweight"][:, :, None] >> shifts) & 15  # [in, out/8, 8]
    q = nibbles[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(128, 64)  # [in, out]
    z = ((state[f"{name}.qzeros"][:, :, None] >> shifts) & 15)[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(4, 64)
    w = (q - z.repeat_interleave(32, dim=0)).float() * state[f"{name}.scales"].float().repeat_interleave(32, dim=0)
    assert torch.equal(w.T, reference[name])
    assert AWQ_ORDER_MAP == [0, 2, 4, 6, 1, 3, 5, 7]
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("group", [32, 64])
def test_an_awq_checkpoint_loads_as_q4_1_blocks(float_model, tmp_path, group):
    reference = write_awq(tmp_path, float_model, group=group)
    loaded = load_checkpoint(tmp_path)
    assert_layers(loaded, reference, "q4_1", exact=False)
    assert type(loaded.lm_head) is torch.nn.Linear
    assert "awq: layers: q4_1;" in loaded.config.fastdecode_checkpoint_note
    assert_logits_close(loaded, with_weights(float_model, reference))


@pytest.mark.parametrize("change, message", [({"version": "gemv"}, "version 'gemv'"), ({"bits": 3}, "bits=3")])
def test_awq_variants_without_a_kernel_are_refused(float_model, tmp_path, change, message):
    write_awq(tmp_path, float_model)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------- GPTQ


def test_the_gptq_writer_follows_autogptq_layout(float_model, tmp_path):
    reference = write_gptq(tmp_path, float_model, bits=4, group=32, symmetric=True)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"  # [32, 64]
    assert state[f"{name}.qweight"].dtype == torch.int32 and state[f"{name}.qweight"].shape == (8, 32)
    assert state[f"{name}.qzeros"].dtype == torch.int32 and state[f"{name}.qzeros"].shape == (2, 4)
    assert state[f"{name}.scales"].dtype == torch.float16 and state[f"{name}.scales"].shape == (2, 32)
    assert torch.equal(state[f"{name}.g_idx"], torch.arange(64, dtype=torch.int32) // 32)
    # AutoGPTQ's dequantization: input row 8 r + k is nibble k of word r; zeros stored minus one (v1).
    shifts = torch.arange(0, 32, 4)
    q = ((state[f"{name}.qweight"][:, None, :] >> shifts[None, :, None]) & 15).reshape(64, 32)
    z = ((state[f"{name}.qzeros"][:, :, None] >> shifts) & 15).reshape(2, 32) + 1
    assert (z == 8).all()  # symmetric
    g = state[f"{name}.g_idx"].long()
    assert torch.equal(((q - z[g]).float() * state[f"{name}.scales"].float()[g]).T, reference[name])


@pytest.mark.parametrize(
    "bits, symmetric, fmt, expected",
    [(4, True, "gptq", "q4_0"), (4, False, "gptq", "q4_1"), (4, False, "gptq_v2", "q4_1"), (8, True, "gptq", "q8_0")],
)
def test_a_gptq_checkpoint_loads_onto_block_kernels(float_model, tmp_path, bits, symmetric, fmt, expected):
    reference = write_gptq(tmp_path, float_model, bits=bits, group=32, symmetric=symmetric, fmt=fmt)
    loaded = load_checkpoint(tmp_path)
    assert_layers(loaded, reference, expected, exact=expected != "q4_1")
    assert_logits_close(loaded, with_weights(float_model, reference))


def test_act_order_gptq_with_a_permutation_is_refused(float_model, tmp_path):
    def permuted(in_features):
        return torch.randperm(in_features, generator=torch.Generator().manual_seed(0)) // 32

    write_gptq(tmp_path, float_model, g_idx=permuted)
    with pytest.raises(ConfigError, match=r"act-order GPTQ \(desc_act=True\) with a permuted g_idx"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 3}, "GPTQ with bits=3 is not supported"),
        ({"bits": 4.0}, "GPTQ with bits=4.0 is not supported"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ],
)
def test_gptq_variants_without_a_kernel_are_refused(float_model, tmp_path, change, message):
    write_gptq(tmp_path, float_model)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as info:
        load_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_a_group_size_the_blocks_cannot_hold_becomes_float_with_a_note(float_model, tmp_path):
    reference = write_gptq(tmp_path, float_model, group=16)
    loaded = load_checkpoint(tmp_path)
    layer = loaded.get_submodule("model.layers.0.mlp.up_proj")
    assert type(layer) is torch.nn.Linear and torch.equal(layer.weight, reference["model.layers.0.mlp.up_proj"])
    assert "dequantized to float" in loaded.config.fastdecode_checkpoint_note
    assert "group size 16 is not a multiple of 32" in loaded.config.fastdecode_checkpoint_note


# ---------------------------------------------------------------- compressed-tensors


@pytest.mark.parametrize("symmetric, group, fmt", [(True, 32, "q4_0"), (True, None, "q4_0"), (False, 64, "q4_1")])
def test_a_w4a16_pack_quantized_checkpoint_loads_as_blocks(float_model, tmp_path, symmetric, group, fmt):
    pytest.importorskip("compressed_tensors")
    reference = write_compressed_tensors(tmp_path, copy.deepcopy(float_model), "pack-quantized", group, symmetric)
    loaded = load_checkpoint(tmp_path)
    assert set(reference) == set(quantized_linears(float_model))
    assert_layers(loaded, reference, fmt, exact=symmetric)
    assert_logits_close(loaded, with_weights(float_model, reference))


def test_transformers_reads_the_same_w4a16_checkpoint_to_the_same_weights(float_model, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    write_compressed_tensors(tmp_path, copy.deepcopy(float_model), "pack-quantized", 32, True)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        theirs(input_ids=torch.tensor([PROMPT[:2]]))  # compressed-tensors decompresses on the first forward
    loaded = load_checkpoint(tmp_path)
    for name in quantized_linears(float_model):
        assert torch.equal(loaded.get_submodule(name).dequantize(), theirs.get_submodule(name).weight.float())
    assert_logits_close(loaded, theirs)


def per_token_fake_quant(model, names):
    """``model`` with the input of each layer in ``names`` rounded to int8 per token (the W8A8 scheme's
    activations, in float): the reference a W8A8 checkpoint's logits are measured against."""
    ref = copy.deepcopy(model)
    for name in names:

        def hook(module, args):
            x = args[0]
            q, d = quantize_tokens_reference(x.reshape(-1, x.shape[-1]))
            return ((q.float() * d[:, None]).view(x.shape).to(x.dtype),)

        ref.get_submodule(name).register_forward_pre_hook(hook)
    return ref


def test_a_w8a8_channel_token_checkpoint_loads_onto_the_w8a8_kernel(float_model, tmp_path):
    pytest.importorskip("compressed_tensors")
    reference = write_compressed_tensors(tmp_path, copy.deepcopy(float_model), "int-quantized", symmetric=True)
    loaded = load_checkpoint(tmp_path)
    for name, w in reference.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, W8A8Linear) and torch.equal(layer.dequantize(), w), name
    assert loaded.config.fastdecode_checkpoint_note == "compressed-tensors: layers: w8a8"
    assert make_target(loaded, "native").weights == "w8a8+float"  # the LM head was not quantized
    fake_quant = per_token_fake_quant(with_weights(float_model, reference), reference)
    with torch.no_grad():
        want = fake_quant(input_ids=torch.tensor([PROMPT])).logits[0]
        hf = loaded(input_ids=torch.tensor([PROMPT])).logits[0]
    native = PagedSequence(make_target(loaded, "native")).forward(PROMPT, len(PROMPT))
    # The same per-token int8 model in float: only float rounding (and a rare tie it flips) apart.
    for logits in (hf, native):
        assert (logits - want).abs().max() < 2e-3 * want.abs().max()
    assert_logits_close(loaded, with_weights(float_model, reference))


def test_int8_without_per_token_activations_keeps_the_q8_0_blocks(float_model, tmp_path):
    pytest.importorskip("compressed_tensors")
    reference = write_compressed_tensors(tmp_path, copy.deepcopy(float_model), "int-quantized", symmetric=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_checkpoint(tmp_path)
    assert_layers(loaded, reference, "q8_0")
    assert loaded.config.fastdecode_checkpoint_note == "compressed-tensors: layers: q8_0"  # exact scales


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    qc = config["quantization_config"]
    for key, value in changes.items():
        if key == "weights":
            qc["config_groups"]["group_0"]["weights"].update(value)
        else:
            qc[key] = value
            qc["config_groups"]["group_0"].pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        ({"weights": {"num_bits": 3}}, "num_bits=3 is not supported"),
        ({"weights": {"num_bits": 4.0}}, "num_bits=4.0 is not supported"),
        ({"sparsity_config": "dense"}, "sparsity_config must be an object"),
        ({"weights": {"type": "float"}}, "float weights are not supported"),
        ({"weights": {"strategy": "block"}}, "strategy 'block' is not supported"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ],
)
def test_compressed_tensors_variants_without_a_kernel_are_refused(float_model, tmp_path, changes, message):
    pytest.importorskip("compressed_tensors")
    write_compressed_tensors(tmp_path, copy.deepcopy(float_model), "pack-quantized", 32, True)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------- through load_model


def test_load_model_detects_a_checkpoint_and_runs_it_on_the_block_kernels(float_model, tmp_path):
    model = tiny_llama(0, **{**KERNEL_FRIENDLY, "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2})
    reference = write_awq(tmp_path, model, tokenizer=word_tokenizer(size=61))
    assert resolve_spec(str(tmp_path)).kind == "checkpoint"
    loaded, tokenizer = load_model(str(tmp_path))
    assert tokenizer("w1 w2")["input_ids"][-2:] == [4, 5]
    assert_layers(loaded, reference, "q4_1", exact=False)
    assert make_target(loaded, "native").weights == "q4_1+float"  # the LM head was not quantized
    with pytest.raises(ConfigError, match="use --device cpu"):
        load_model(str(tmp_path), device="mps")
    half, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert half(input_ids=torch.tensor([[1, 5, 9, 22]])).logits.dtype == torch.bfloat16


def test_an_unknown_quant_method_is_one_clear_error(tmp_path):
    write_gptq(tmp_path, tiny_llama(0, **KERNEL_FRIENDLY))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "bitsandbytes"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes' is not one fastdecode loads"):
        load_model(str(tmp_path))


def test_a_checkpoint_missing_a_tensor_is_refused(float_model, tmp_path):
    from safetensors.torch import save_file

    write_gptq(tmp_path, float_model)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(Exception, match=r"no tensor 'model\.layers\.1\.mlp\.down_proj\.scales'"):
        load_checkpoint(tmp_path)


def test_asymmetric_int8_past_int8s_range_becomes_float_with_a_note(float_model, tmp_path):
    """w8a8 and q8_0 have no zero point: where q - zero_point leaves -128..127 the layer is dequantized."""
    pytest.importorskip("compressed_tensors")
    reference = write_compressed_tensors(tmp_path, copy.deepcopy(float_model), "int-quantized", symmetric=False)
    loaded = load_checkpoint(tmp_path)
    note = loaded.config.fastdecode_checkpoint_note
    assert "asymmetric int8 whose q - zero leaves int8's range" in note
    for name, w in reference.items():
        layer = loaded.get_submodule(name)
        low_bit = isinstance(layer, (GGUFBlockLinear, W8A8Linear))
        assert torch.equal(layer.dequantize() if low_bit else layer.weight, w), name
