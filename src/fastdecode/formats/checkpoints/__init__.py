"""Quantized model directories other tools write, loaded onto fastdecode's kernels; and
fastdecode's own compressions written as compressed-tensors for other engines.

A directory is one of these when its ``config.json`` holds a ``quantization_config`` whose
``quant_method`` names a reader here (:data:`CHECKPOINT_READERS`, one file per family):

* ``compressed-tensors`` (llm-compressor): ``pack-quantized`` (W4A16: int4 packed in int32,
  per-group or per-channel scales, symmetric or with zero points; 8-bit packed the same
  way) and ``int-quantized`` / ``naive-quantized`` (W8A8: int8 weights, per-channel scales,
  activations quantized dynamically per token: on the ``w8a8`` kernel, the same scheme; other
  int8 variants on the q8_0 kernels, activations per block of 32);
* ``awq`` (AutoAWQ, version ``gemm``);
* ``gptq`` (AutoGPTQ / GPTQModel, ``checkpoint_format`` ``gptq`` or ``gptq_v2``).

Each layer runs on the integer kernels without passing through float where a block of 32
input columns lies in one group (``int_weights``: q4_0, q4_1, q8_0; w8a8 per channel), else as a float
layer of its dequantized values, said in the model's ``config.fastdecode_checkpoint_note``.
A variant no mapping covers (GPTQ act-order with a permuted ``g_idx``, 3-bit weights, an
unknown format, fp8) is one :class:`~fastdecode.errors.ConfigError` naming it.

    model = load_checkpoint("llama-w4a16/", torch.float32)   # GGUFBlockLinear layers
    save_compressed_tensors(model, tokenizer, "out/")          # a fastdecode-quantized model
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.checkpoints.autoawq import AWQ_READER
from fastdecode.formats.checkpoints.compressed_tensors import COMPRESSED_TENSORS_READER, save_compressed_tensors
from fastdecode.formats.checkpoints.gptq import GPTQ_READER
from fastdecode.formats.checkpoints.loader import CheckpointReader, build_model, quantization_config, read_config

__all__ = ["CHECKPOINT_READERS", "CheckpointReader", "checkpoint_method", "load_checkpoint", "save_compressed_tensors"]

CHECKPOINT_READERS: dict[str, CheckpointReader] = {
    r.method: r for r in (COMPRESSED_TENSORS_READER, AWQ_READER, GPTQ_READER)
}


def checkpoint_method(path: str | Path) -> str | None:
    """The ``quant_method`` of directory ``path``'s ``config.json`` (None when it has no
    ``quantization_config``); a method no reader takes is a ConfigError listing those that are."""
    path = Path(path)
    qc = quantization_config(read_config(path), path)
    if qc is None:
        return None
    method = qc["quant_method"].lower()
    if method not in CHECKPOINT_READERS:
        raise ConfigError(
            f"{path}: quantization_config.quant_method {qc['quant_method']!r} is not one fastdecode loads "
            f"(it loads {', '.join(CHECKPOINT_READERS)})"
        )
    return method


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model in directory ``path`` (see the module docstring), in eval mode on the CPU,
    its float tensors in ``dtype``. ``model.config.fastdecode_checkpoint_note`` says which
    numeric model each layer runs and what was rounded."""
    path = Path(path)
    method = checkpoint_method(path)
    if method is None:
        raise ConfigError(f"{path}: config.json has no quantization_config")
    qc = quantization_config(read_config(path), path)
    model, conversion = build_model(path, CHECKPOINT_READERS[method], qc, dtype)
    model.config.fastdecode_checkpoint_note = f"{method}: {conversion.note}"
    return model
