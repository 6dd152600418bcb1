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
from fastdecode.loaders.gguf_model import ATTR, EXPERTS_ATTR, _set_param, set_source


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
    # a 3-D experts parameter -> its per-expert tensors: ([gate per expert], [up ...]) or ([down ...],)
    experts: dict[str, tuple[list[SafetensorsTensor], ...]]

    @property
    def size(self) -> int:
        return sum(os.path.getsize(p) for p in {t.path for t in self.names.values()})

    def materialize(self, model, dtype: torch.dtype) -> None:
        for hf_name, ref in self.names.items():
            if model.get_parameter(hf_name).device.type == "meta":
                _set_param(model, hf_name, ref.float_weight().to(dtype))
        for hf_name, parts in self.experts.items():  # per expert [gate; up] or down, stacked: [E, rows, cols]
            if model.get_parameter(hf_name).device.type == "meta":
                w = torch.stack([torch.cat([r.float_weight() for r in refs]) for refs in zip(*parts)])
                _set_param(model, hf_name, w.to(dtype))


# transformers' 3-D experts parameters -> the per-expert tensors checkpoints hold (Qwen2/3-MoE, OLMoE:
# ``mlp.experts.{e}.gate_proj.weight``; transformers fuses them when it loads, and saves them so)
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _per_expert(name: str, shape: tuple[int, ...], shards: dict[str, str], location: str):
    """The per-expert tensors of 3-D experts parameter ``name`` (shape [E, rows, cols]), or None where
    the checkpoint does not hold them so; each checked against its share of the parameter."""
    from safetensors import safe_open

    base, _, suffix = name.rpartition(".")
    if len(shape) != 3 or suffix not in _EXPERT_PARTS:
        return None
    parts = _EXPERT_PARTS[suffix]
    want = (shape[1] // len(parts), shape[2])
    names = [[f"{base}.{e}.{p}.weight" for e in range(shape[0])] for p in parts]
    if not all(n in shards for group in names for n in group):
        return None
    refs = []
    for group in names:
        for n in group:
            with safe_open(shards[n], framework="pt") as fh:
                stored = tuple(fh.get_slice(n).get_shape())
            if stored != want:
                raise ModelLoadError(
                    f"{location}: expert tensor {n!r} has shape {list(stored)}, but the config needs {list(want)}"
                )
        refs.append([SafetensorsTensor(shards[n], n, want) for n in group])
    return tuple(refs)


def _hang_experts(model, experts: dict[str, tuple[list[SafetensorsTensor], ...]]) -> None:
    """Each experts module gets, under EXPERTS_ATTR, per expert where its gate, up and down lie."""
    owners: dict[str, dict[str, tuple]] = {}
    for name, parts in experts.items():
        owner, _, suffix = name.rpartition(".")
        owners.setdefault(owner, {})[suffix] = parts
    for owner, by_param in owners.items():
        if set(by_param) == set(_EXPERT_PARTS):
            setattr(model.get_submodule(owner), EXPERTS_ATTR, (*by_param["gate_up_proj"], *by_param["down_proj"]))


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
    experts = {}
    for name in [n for n in needed if n not in shards]:
        experts[name] = _per_expert(name, tuple(params[name].shape), shards, location)
        if experts[name] is None:
            return None
    refs: dict[str, SafetensorsTensor] = {}
    for name in (n for n in needed if n not in experts):
        shape = tuple(params[name].shape)
        with safe_open(shards[name], framework="pt") as fh:
            stored = tuple(fh.get_slice(name).get_shape())
        if stored != shape:
            raise ModelLoadError(
                f"{location}: tensor {name!r} has shape {list(stored)}, but the config needs {list(shape)}"
            )
        if len(shape) == 2 and name.endswith(".weight"):
            refs[name] = SafetensorsTensor(shards[name], name, shape)
            setattr(model.get_submodule(name.rpartition(".")[0]), ATTR, refs[name])
        else:  # norms and biases (gpt-oss's experts' [E, rows] too): small, read now; 3-D experts stored whole too
            with safe_open(shards[name], framework="pt") as fh:
                _set_param(model, name, fh.get_tensor(name).to(torch.float32).reshape(shape))
    if tied:
        embed = model.get_input_embeddings()
        setattr(model.get_output_embeddings(), ATTR, getattr(embed, ATTR))
    if (Path(location) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(location)
    _hang_experts(model, experts)
    set_source(model, SafetensorsSource(location, refs, experts))
    model.config.fastdecode_gguf_file = None
    return model.eval()
