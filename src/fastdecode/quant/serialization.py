"""Save and load quantized models as a directory (safetensors only, never pickle).

Layout of a quantized directory::

    fastdecode_quant.json          format version, method settings, per-layer layout
                                   (for GGUF block formats: the format and [out, in])
    fastdecode_quant.safetensors   the full state dict (packed weights included, GGUF
                                   blocks as their raw bytes in uint8 tensors, tied
                                   tensors stored once)
    config.json                    the model's transformers config
    generation_config.json         if the model has one
    tokenizer files                if a tokenizer was given

The weights file is deliberately not called ``model.safetensors``: transformers'
``from_pretrained`` on this directory then fails plainly instead of loading a
float model with its Linear weights missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.formats import saved_layers
from fastdecode.quant.api import quantized_layers

QUANT_JSON = "fastdecode_quant.json"
WEIGHTS_FILE = "fastdecode_quant.safetensors"
FORMAT_VERSION = 1
SAVE_FORMATS = ("fastdecode", "compressed-tensors")  # save_quantized's format (a CLI's --save-format)


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / QUANT_JSON).is_file()


def save_quantized(model: nn.Module, tokenizer, out_dir: str | Path, config, format: str = "fastdecode") -> Path:
    """Write ``model`` (already passed through ``quantize_(model, config)``) to ``out_dir``.

    ``format``: ``"fastdecode"`` (this module's layout) or ``"compressed-tensors"`` (a directory
    vLLM and transformers read: ``fastdecode.formats.checkpoints.save_compressed_tensors``,
    for models at q4_0, q8_0 or int8), one of :data:`SAVE_FORMATS`.

    ``config`` is recorded for the reader's benefit; loading needs only the
    per-layer layout, read from the model itself. ``tokenizer`` may be None.
    The files are written beside ``out_dir`` and moved in when all are complete,
    :data:`QUANT_JSON` last, so an error or Ctrl-C never leaves a half-written model.
    """
    from safetensors.torch import save_model

    from fastdecode.util.files import staged_dir

    if format not in SAVE_FORMATS:
        raise ConfigError(f"unknown save format {format!r}; choose one of {', '.join(SAVE_FORMATS)}")
    if format == "compressed-tensors":
        from fastdecode.formats.checkpoints.compressed_tensors_save import save_compressed_tensors

        return save_compressed_tensors(model, tokenizer, out_dir)
    layers = quantized_layers(model)
    if not layers:
        raise ConfigError("the model has no quantized layers; run quantize_(model, config) first")
    out_dir = Path(out_dir)
    record = {
        "format_version": FORMAT_VERSION,
        "quantization": config.to_dict(),
        "dtype": str(_float_dtype(model)).removeprefix("torch."),
        "layers": layers,
    }
    # QUANT_JSON's presence marks a complete directory (see is_quantized_dir).
    with staged_dir(out_dir, marker=QUANT_JSON) as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / QUANT_JSON).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return out_dir


PRUNED_JSON = "fastdecode_pruning.json"  # beside a float model that compress pruned without quantizing


def save_float(model: nn.Module, tokenizer, out_dir: str | Path, config) -> Path:
    """Write a model whose weights are still float (pruned, not quantized) as a plain model
    directory (transformers' safetensors layout; ``--model DIR`` loads it as any other), with
    ``config``'s record in :data:`PRUNED_JSON`; written whole or not at all, as :func:`save_quantized`."""
    from fastdecode.util.files import staged_dir

    if quantized_layers(model):
        raise ConfigError("the model has quantized layers: save it with save_quantized")
    out_dir = Path(out_dir)
    record = {"format_version": FORMAT_VERSION, "compression": config.to_dict()}
    with staged_dir(out_dir, marker="config.json") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        (tmp / PRUNED_JSON).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return out_dir


def load_quantized(path: str | Path, device: str = "cpu") -> tuple[nn.Module, object]:
    """(model in eval mode, tokenizer or None) from a directory :func:`save_quantized` wrote."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if torch.device(device).type != "cpu":
        raise ConfigError(f"quantized layers run torch's CPU kernels; cannot load onto {device!r}")
    path = Path(path)
    record = _read_record(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ModelLoadError(f"{path}: missing {WEIGHTS_FILE}")
    try:
        model_config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError variously
        raise ModelLoadError(f"{path}: unreadable config.json ({e})") from e
    dtype = getattr(torch, record["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(f"{path}/{QUANT_JSON}: unknown dtype {record['dtype']!r}")

    model = _empty_model(AutoModelForCausalLM, model_config, dtype)
    for name, layout in record["layers"].items():
        _install_layer(model, name, layout, dtype, path)
    try:
        load_model(model, str(weights), strict=True, device="cpu")
    except (SafetensorError, RuntimeError, ValueError, OSError) as e:
        detail = " ".join(str(e).split())  # torch lists a state dict's errors on indented lines
        raise ModelLoadError(f"{path}: corrupt or mismatched {WEIGHTS_FILE} ({detail})") from e
    model.eval()
    return model, _load_tokenizer(path)


def _read_record(path: Path) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory")
    try:
        record = json.loads((path / QUANT_JSON).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: not a quantized model directory (no {QUANT_JSON})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}/{QUANT_JSON}: corrupt ({e})") from None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(
            f"{path}/{QUANT_JSON}: unsupported format_version {record.get('format_version') if isinstance(record, dict) else None!r}"
        )
    if not isinstance(record.get("layers"), dict) or "dtype" not in record:
        raise ModelLoadError(f"{path}/{QUANT_JSON}: missing 'layers' or 'dtype'")
    return record


def _empty_model(auto_cls, model_config, dtype: torch.dtype) -> nn.Module:
    """The architecture with uninitialized weights: every one is overwritten by the load."""
    from transformers.initialization import no_init_weights

    try:
        with no_init_weights():
            model = auto_cls.from_config(model_config, dtype=dtype)
        # Skipping initialization also skips tying the LM head to the embeddings;
        # the weights file stores a tied tensor once, so the tie must be restored.
        model.tie_weights()
        return model
    except Exception as e:
        raise ModelLoadError(f"cannot build {model_config.model_type!r} from its config ({e})") from e


def _install_layer(model: nn.Module, name: str, layout: dict, dtype: torch.dtype, path: Path) -> None:
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise ModelLoadError(f"{path}/{QUANT_JSON}: the model has no layer {name!r}") from None
    spec = saved_layers().get(layout.get("kind")) if isinstance(layout, dict) else None  # each format's SavedLayer
    cls = None if spec is None else spec.module
    if not isinstance(linear, nn.Linear) or cls is None:
        raise ModelLoadError(f"{path}/{QUANT_JSON}: cannot install {layout!r} at {name!r}")
    shape = [linear.out_features, linear.in_features]
    if "shape" in layout and layout["shape"] != shape:
        raise ModelLoadError(
            f"{path}/{QUANT_JSON}: layer {name!r} is recorded as {layout['shape']!r} "
            f"[out, in], the model's config makes it {shape}"
        )
    try:
        extra = {"group_size": int(layout["group_size"])} if "group_size" in layout else {}
        if "format" in layout:  # GGUF block formats
            extra["format"] = str(layout["format"])
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=dtype, **extra)
    except (ConfigError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}/{QUANT_JSON}: layer {name!r}: {e}") from None
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: unreadable tokenizer files ({e})") from e


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
