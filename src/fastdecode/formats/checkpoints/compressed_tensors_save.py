"""fastdecode's compressions written as a compressed-tensors directory other engines read
(vLLM, transformers with the ``compressed-tensors`` package, llm-compressor).

Every layer is written exactly, symmetric, with the layout ``compressed_tensors.py`` describes
(the one compressed-tensors 0.20 writes): ``pack-quantized``, but W8A8 ``int-quantized``:

=========================  ================================================================
fastdecode layer           compressed-tensors scheme
=========================  ================================================================
q4_0 (``GGUFBlockLinear``)  4 bits, strategy ``group``, group_size 32: q = nibble - 8,
                            scale = the block's fp16 d
q8_0 (``GGUFBlockLinear``)  8 bits, strategy ``group``, group_size 32: q and d as stored
int8 (``Int8WeightOnly``)   8 bits, strategy ``channel``: q and the row's scale
w8a8 (``W8A8Linear``)       ``int-quantized``: int8 ``weight`` and the row's scale, strategy
                            ``channel``; ``input_activations`` int8, dynamic, per ``token``
=========================  ================================================================

(W8A8's activations: fastdecode scales a token by max|x| / 127 into -127..127, compressed-tensors
by max|x| / 127.5 into -128..127; the weights are the same.)

Scales are stored in the model's float dtype where it holds them exactly, else float32.
q4_1 (a float minimum per block) and torch's int4 (a float zero per group) have no exact
integer zero point, so a model holding them is refused (ConfigError naming the layer):
compress with q4_0, q8_0, int8 or w8a8 for compressed-tensors output. Layers still float are
listed in ``ignore`` and saved as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.checkpoints.int_weights import pack_int32
from fastdecode.quant.linear import GGUFBlockLinear, Int4WeightOnlyLinear, Int8WeightOnlyLinear, W8A8Linear

FORMAT_VERSION = "0.20.0"  # the compressed-tensors release whose layout this writes
WEIGHTS_FILE = "model.safetensors"


def _scale_dtype(scale: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if torch.equal(scale.to(dtype).float(), scale.float()) else torch.float32


def _compress(name: str, module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict[str, torch.Tensor]] | None:
    """((bits, strategy, group_size, activations), the layer's compressed tensors) or None for a float layer."""
    if isinstance(module, W8A8Linear):
        scale = module.scales.float().reshape(-1, 1)
        tensors = {"weight": module.qweight.contiguous(), "weight_scale": scale.to(_scale_dtype(scale, dtype))}
        if module.bias is not None:
            tensors["bias"] = module.bias.detach().to(dtype).contiguous()
        return (8, "channel", None, "token"), tensors
    if isinstance(module, GGUFBlockLinear):
        if module.format not in ("q4_0", "q8_0"):
            raise ConfigError(
                f"{name} is {module.format}: its float minimum per block has no exact compressed-tensors form "
                "(compress with q4_0, q8_0, int8 or w8a8 for compressed-tensors output)"
            )
        q, d, _ = module.block_tensor().fields()  # q [out, nb, 32], d fp16 [out, nb, 1]
        bits = 4 if module.format == "q4_0" else 8
        values = torch.from_numpy(q.astype("int32")).reshape(module.out_features, -1)[:, : module.in_features]
        unsigned = values if bits == 4 else values + 128  # stored q + 2^(bits - 1); q4_0's nibble is q + 8
        scale = torch.from_numpy(d.astype("float32"))[..., 0]
        key = (bits, "group", 32, None)
    elif isinstance(module, Int8WeightOnlyLinear):
        unsigned = module.qweight.to(torch.int32) + 128
        scale = module.scales.float().reshape(-1, 1)
        key = (8, "channel", None, None)
    elif isinstance(module, Int4WeightOnlyLinear):
        raise ConfigError(
            f"{name} is torch's int4 (a float zero per group): it has no exact compressed-tensors form "
            "(compress with q4_0, q8_0, int8 or w8a8 for compressed-tensors output)"
        )
    elif type(module) is nn.Linear or not hasattr(module, "in_features"):
        return None
    else:
        raise ConfigError(f"{name}: {type(module).__name__} layers cannot be written as compressed-tensors")
    tensors = {
        "weight_packed": pack_int32(unsigned, key[0]),
        "weight_scale": scale.to(_scale_dtype(scale, dtype)).contiguous(),
        "weight_shape": torch.tensor([module.out_features, module.in_features], dtype=torch.int64),
    }
    if module.bias is not None:
        tensors["bias"] = module.bias.detach().to(dtype).contiguous()
    return key, tensors


# W8A8's activations: int8, symmetric, per token, scaled as each pass runs
TOKEN_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def _scheme(key: tuple, targets: list[str]) -> dict:
    bits, strategy, group_size, activations = key
    return {
        "targets": targets,
        "weights": {
            "num_bits": bits,
            "type": "int",
            "symmetric": True,
            "strategy": strategy,
            "group_size": group_size,
            "dynamic": False,
            "actorder": None,
        },
        "input_activations": None if activations is None else dict(TOKEN_ACTIVATIONS),
        "output_activations": None,
        "format": "pack-quantized" if activations is None else "int-quantized",
    }


def _float_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def compressed_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """(the tensors to write, the ``quantization_config``) of a fastdecode-quantized model."""
    dtype = _float_dtype(model)
    state, groups, floats, owned = {}, {}, [], set()
    for name, module in model.named_modules():
        compressed = _compress(name, module, dtype) if name else None
        if compressed is None:
            if type(module) is nn.Linear:
                floats.append(name)
            continue
        key, tensors = compressed
        groups.setdefault(key, []).append(name)
        owned.add(name)
        state.update({f"{name}.{k}": v for k, v in tensors.items()})
    if not groups:
        raise ConfigError("the model has no quantized layers to write; quantize it first")
    seen = set()
    for key, t in model.state_dict().items():
        where = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key.rpartition(".")[0] in owned or where in seen:
            continue  # a quantized layer's data, or a tied tensor stored once
        seen.add(where)
        state[key] = t.detach().contiguous()
    schemes = {f"group_{i}": _scheme(key, names) for i, (key, names) in enumerate(groups.items())}
    formats = {scheme["format"] for scheme in schemes.values()}
    config = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",  # each group names its own
        "config_groups": schemes,
        "ignore": floats,
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": FORMAT_VERSION,
    }
    return state, config


def save_compressed_tensors(model: nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """Write ``model`` (quantized by fastdecode to q4_0, q8_0, int8 or w8a8) to ``out_dir`` as a
    compressed-tensors directory: ``config.json`` with its ``quantization_config``,
    ``model.safetensors``, ``generation_config.json`` and the tokenizer (if not None).
    Files are staged beside ``out_dir`` and moved in complete, ``config.json`` last."""
    from safetensors.torch import save_file

    from fastdecode.util.files import staged_dir

    state, quantization = compressed_state(model)
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("fastdecode_")}
    config["quantization_config"] = quantization
    with staged_dir(out_dir, marker="config.json") as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return Path(out_dir)
