"""A Hugging Face safetensors directory as a skeleton (``gguf_model``'s shape): the model's modules on
the meta device, each weight a :class:`SafetensorsTensor` read when a backend asks.

So ``--weights q8_0|q4_0|q4_1|...`` quantizes layer by layer from the shards, one tensor's float32 at a
time, and peak memory is the quantized model plus about one tensor of float; ``--weights float`` and the
transformers backend read every weight (:func:`~fastdecode.loaders.gguf_model.materialize`), the same
values ``from_pretrained`` gives (a test compares them). Each read opens the shard, copies the tensor out
and closes it, so no shard's pages stay mapped into the process.

Where the checkpoint's names are not the model's own (an architecture transformers converts while
loading), :func:`load_safetensors_dir` returns None and the caller loads through transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastdecode.errors import ModelLoadError
from fastdecode.loaders.gguf_model import ATTR, _set_param, set_source


def shard_index(location: str) -> dict[str, str] | None:
    """Checkpoint tensor name -> shard path of a local directory, or None without safetensors."""
    root = Path(location)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: str(root / shard) for name, shard in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as fh:
        return {name: str(single) for name in fh.keys()}  # noqa: SIM118 (safe_open is not a mapping)


@dataclass(frozen=True, eq=False)
class SafetensorsTensor:
    """One weight ``name`` of shard ``path``, [rows, cols]."""

    path: str
    name: str
    shape: tuple[int, int]
    type_name: str = "safetensors"

    def blocks(self):
        return None  # float weights: a block format quantizes them (float_weight)

    def float_weight(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as fh:
            return fh.get_tensor(self.name).to(torch.float32).contiguous()

    def rows(self, index: np.ndarray) -> torch.Tensor:
        from safetensors import safe_open

        out = torch.empty(len(index), self.shape[1])
        with safe_open(self.path, framework="pt") as fh:
            table = fh.get_slice(self.name)
            for i, row in enumerate(index.tolist()):
                out[i] = table[row : row + 1].to(torch.float32)[0]
        return out


@dataclass(frozen=True, eq=False)
class SafetensorsSource:
    path: str
    names: dict[str, SafetensorsTensor]  # HF parameter name -> its tensor (2-D weights only)

    @property
    def size(self) -> int:
        return sum(os.path.getsize(p) for p in {t.path for t in self.names.values()})

    def materialize(self, model, dtype: torch.dtype) -> None:
        for hf_name, ref in self.names.items():
            if model.get_parameter(hf_name).device.type == "meta":
                _set_param(model, hf_name, ref.float_weight().to(dtype))


def load_safetensors_dir(location: str, config):
    """The skeleton of the model in ``location`` (config already read), or None where its checkpoint
    names are not the model's own or it has no safetensors (then load it through transformers)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    shards = shard_index(location)
    if shards is None:
        return None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(config, "tie_word_embeddings", False)
    needed = [n for n in params if not (tied and n == "lm_head.weight")]
    if any(n not in shards for n in needed):
        return None
    refs: dict[str, SafetensorsTensor] = {}
    for name in needed:
        shape = tuple(params[name].shape)
        with safe_open(shards[name], framework="pt") as fh:
            stored = tuple(fh.get_slice(name).get_shape())
        if stored != shape:
            raise ModelLoadError(
                f"{location}: tensor {name!r} has shape {list(stored)}, but the config needs {list(shape)}"
            )
        if len(shape) == 2:
            refs[name] = SafetensorsTensor(shards[name], name, shape)
            setattr(model.get_submodule(name.rpartition(".")[0]), ATTR, refs[name])
        else:  # norms and biases: small, read now
            with safe_open(shards[name], framework="pt") as fh:
                _set_param(model, name, fh.get_tensor(name).to(torch.float32).reshape(shape))
    if tied:
        embed = model.get_input_embeddings()
        setattr(model.get_output_embeddings(), ATTR, getattr(embed, ATTR))
    if (Path(location) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(location)
    set_source(model, SafetensorsSource(location, refs))
    model.config.fastdecode_gguf_file = None
    return model.eval()
