"""fastdecode's compressions written as compressed-tensors: the compressed-tensors library
(through transformers) decompresses them to exactly the weights fastdecode's layers hold, and
fastdecode reads them back to the very same blocks."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import KERNEL_FRIENDLY, tiny_llama, word_tokenizer

from fastdecode.backends import PagedSequence, make_target
from fastdecode.errors import ConfigError
from fastdecode.formats import saved_layer_of
from fastdecode.formats.checkpoints import load_checkpoint, save_compressed_tensors
from fastdecode.loading import load_model
from fastdecode.quant import config_from_method, quantize_, save_quantized
from fastdecode.quant.linear import GGUFBlockLinear, W8A8Linear

PROMPT = [1, 40, 61, 9, 55, 23, 8, 14, 40, 17, 9, 55, 23, 8, 14, 40]
CONFIG = {**KERNEL_FRIENDLY, "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2}


def quantized(method: str):
    model = tiny_llama(0, **CONFIG)
    quantize_(model, config_from_method(method))
    return model


@pytest.mark.parametrize("method, bits, strategy", [("q4_0", 4, "group"), ("q8_0", 8, "group"), ("int8", 8, "channel")])
def test_the_written_directory_follows_the_pack_quantized_layout(tmp_path, method, bits, strategy):
    model = quantized(method)
    save_compressed_tensors(model, word_tokenizer(size=61), tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["weights"] == {
        "num_bits": bits,
        "type": "int",
        "symmetric": True,
        "strategy": strategy,
        "group_size": 32 if strategy == "group" else None,
        "dynamic": False,
        "actorder": None,
    }
    assert len(group["targets"]) == 14 and group["format"] == "pack-quantized"
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert state[f"{name}.weight_packed"].dtype == torch.int32
    assert state[f"{name}.weight_packed"].shape == (64, 128 * bits // 32)
    assert state[f"{name}.weight_scale"].shape == ((64, 4) if strategy == "group" else (64, 1))
    assert state[f"{name}.weight_shape"].tolist() == [64, 128]
    assert f"{name}.weight" not in state and f"{name}.weight_zero_point" not in state
    # value k of a word at bits k * b, stored as q + 2^(b - 1): the library's own unpacking
    from_library = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = from_library.unpack_from_int32(state[f"{name}.weight_packed"], bits, torch.Size([64, 128]))
    scale = state[f"{name}.weight_scale"].float().repeat_interleave(32 if strategy == "group" else 128, dim=1)
    assert torch.equal(q.float() * scale, model.get_submodule(name).dequantize())


@pytest.mark.parametrize("method", ["q4_0", "q8_0", "int8", "w8a8"])
def test_transformers_with_compressed_tensors_reads_the_same_weights(tmp_path, method):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    model = quantized(method)
    save_compressed_tensors(model, None, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        theirs(input_ids=torch.tensor([PROMPT[:2]]))  # compressed-tensors decompresses on the first forward
    for name, module in model.named_modules():
        if saved_layer_of(module) is not None:
            assert torch.equal(theirs.get_submodule(name).weight.float(), module.dequantize()), name
    assert torch.equal(theirs.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("method", ["q4_0", "q8_0"])
def test_fastdecode_reads_its_compressed_tensors_back_to_the_same_blocks(tmp_path, method):
    model = quantized(method)
    save_quantized(model, word_tokenizer(size=61), tmp_path, config_from_method(method), format="compressed-tensors")
    loaded, tokenizer = load_model(str(tmp_path))
    assert tokenizer is not None
    for name, module in model.named_modules():
        if isinstance(module, GGUFBlockLinear):
            again = loaded.get_submodule(name)
            assert again.format == method and torch.equal(again.blocks, module.blocks), name
    want = PagedSequence(make_target(model, "native")).forward(PROMPT, len(PROMPT))
    assert torch.equal(PagedSequence(make_target(loaded, "native")).forward(PROMPT, len(PROMPT)), want)


def test_w8a8_is_written_int_quantized_with_per_token_activations_and_reads_back_exactly(tmp_path):
    model = quantized("w8a8")
    save_compressed_tensors(model, None, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == group["format"] == "int-quantized"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    loaded = load_checkpoint(tmp_path)
    for name, module in model.named_modules():
        if isinstance(module, W8A8Linear):
            again = loaded.get_submodule(name)
            assert isinstance(again, W8A8Linear) and torch.equal(again.qweight, module.qweight), name
            assert torch.equal(again.scales, module.scales), name
    want = PagedSequence(make_target(model, "native")).forward(PROMPT, len(PROMPT))
    assert torch.equal(PagedSequence(make_target(loaded, "native")).forward(PROMPT, len(PROMPT)), want)


def test_int8_reads_back_as_q8_0_of_the_same_values(tmp_path):
    model = quantized("int8")
    save_compressed_tensors(model, None, tmp_path)
    loaded = load_checkpoint(tmp_path)
    for name, module in model.named_modules():
        if saved_layer_of(module) is not None:
            again = loaded.get_submodule(name)
            assert again.format == "q8_0" and torch.equal(again.dequantize(), module.dequantize()), name


@pytest.mark.parametrize("method, message", [("q4_1", "q4_1: its float minimum"), ("int4", "torch's int4")])
def test_layers_without_an_exact_form_are_refused(tmp_path, method, message):
    with pytest.raises(ConfigError, match=message):
        save_compressed_tensors(quantized(method), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_float_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no quantized layers"):
        save_compressed_tensors(copy.deepcopy(tiny_llama(0, **CONFIG)), None, tmp_path)


def test_an_unknown_save_format_is_refused(tmp_path):
    model = quantized("q4_0")
    with pytest.raises(ConfigError, match="unknown save format 'awq'"):
        save_quantized(model, None, tmp_path, config_from_method("q4_0"), format="awq")
