"""Build a transformers model from a quantized checkpoint directory another tool wrote.

The architecture comes from ``config.json`` (its ``quantization_config`` read by the family's
reader, then dropped: transformers must not apply a quantizer of its own), built with empty
weights; each quantized linear layer becomes the module :func:`int_weights.to_module` gives
(GGUF blocks on fastdecode's integer kernels, float where no kernel fits); every other tensor
(embeddings, norms, float layers) is copied in, cast to ``dtype``. A tensor the model lacks,
a model tensor the checkpoint lacks, or a checkpoint tensor nothing read is one
:class:`ModelLoadError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.formats.checkpoints.int_weights import Conversion, IntWeight, to_module
from fastdecode.formats.checkpoints.tensors import Tensors

# (quantization_config, tensors, the model's nn.Linear modules by name) -> IntWeight by layer name
ReadLayers = Callable[[dict, Tensors, dict[str, nn.Linear]], dict[str, IntWeight]]


@dataclass(frozen=True)
class CheckpointReader:
    """One checkpoint family: its ``quant_method`` and how its quantized layers are read."""

    method: str
    read_layers: ReadLayers


def read_config(path: Path) -> dict:
    """``config.json`` as a dict (a missing, unreadable or non-object file: ModelLoadError)."""
    file = path / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise ModelLoadError(f"{file}: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: not a JSON object")
    return config


def quantization_config(config: dict, path: Path) -> dict | None:
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        raise ConfigError(f"{path}/config.json: quantization_config must be an object with a quant_method string")
    return qc


def build_model(path: Path, reader: CheckpointReader, qc: dict, dtype: torch.dtype) -> tuple[nn.Module, Conversion]:
    """(the model in eval mode on the CPU, what became of its quantized layers)."""
    tensors = Tensors(path)
    model = _empty_model(path, dtype)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    try:
        weights = reader.read_layers(qc, tensors, linears)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {reader.method} checkpoint: {exc}") from None
    conversion = Conversion()
    for name, weight in weights.items():
        linear = linears[name]
        if weight.shape != (linear.out_features, linear.in_features):
            raise ModelLoadError(
                f"{path}: layer {name!r} is stored as {list(weight.shape)} [out, in]; the config makes it "
                f"{[linear.out_features, linear.in_features]}"
            )
        bias = tensors.optional(f"{name}.bias")
        if (bias is None) != (linear.bias is None):
            raise ModelLoadError(f"{path}: layer {name!r}: the bias does not match the architecture")
        _set_module(model, name, to_module(name, weight, None if bias is None else bias.float(), conversion))
    _load_float_tensors(model, tensors, path, set(weights))
    left = tensors.left()
    if left:
        raise ModelLoadError(f"{path}: {len(left)} tensor(s) the model does not use (such as {left[0]!r})")
    model.eval()
    return model, conversion


def _empty_model(path: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises OSError / ValueError / KeyError variously
        raise ModelLoadError(f"{path}: cannot read the model configuration ({exc})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{path}: unsupported architecture {config.model_type!r}: fastdecode needs a causal LM")
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # read by fastdecode; transformers must not quantize again
    try:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build {config.model_type!r} from its config ({exc})") from None
    model.tie_weights()  # the LM head shares the embeddings' storage when the config ties them
    return model


def _load_float_tensors(model: nn.Module, tensors: Tensors, path: Path, quantized: set) -> None:
    tied = _tied_names(model)
    with torch.no_grad():
        for key, target in model.state_dict(keep_vars=True).items():
            owner = key.rpartition(".")[0]
            if owner in quantized:
                continue  # the quantized layer's own data, built from the checkpoint already
            if key not in tensors:
                if key in tied:
                    continue
                raise ModelLoadError(f"{path}: the checkpoint has no tensor {key!r}")
            value = tensors.get(key)
            if tuple(value.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"{path}: tensor {key!r} is {list(value.shape)}, the architecture needs {list(target.shape)}"
                )
            if target.is_floating_point() != value.is_floating_point():
                raise ModelLoadError(f"{path}: tensor {key!r} is {value.dtype}, the architecture holds {target.dtype}")
            target.data.copy_(value.to(target.dtype))  # float tensors in the model's dtype


def _tied_names(model: nn.Module) -> set[str]:
    """State-dict keys sharing storage with an earlier one (a tied LM head)."""
    seen, tied = set(), set()
    for key, t in model.state_dict(keep_vars=True).items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ptr in seen and t.numel():
            tied.add(key)
        seen.add(ptr)
    return tied


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
