"""compressed-tensors checkpoints (llm-compressor's output, ``quant_method: "compressed-tensors"``).

``quantization_config`` names the schemes (``config_groups``: each with ``targets``, its
``weights`` arguments, ``input_activations`` and, in recent releases, its own ``format``;
else the top-level ``format``) and the modules left float (``ignore``). A target is a class
name (``"Linear"``), a module name, or ``"re:"`` and a regular expression matched against
the module name from its start. A quantized linear layer ``name`` [out, in] is stored as:

* ``pack-quantized`` (W4A16; W8A16): ``name.weight_packed`` int32 [out, ceil(in * b / 32)],
  value k of a word (bits ``k * b``) column ``32 / b * word + k``, stored as ``q + 2^(b-1)``;
  ``name.weight_shape`` int [2] = [out, in]; ``name.weight_scale`` [out, n_groups];
  with zero points, ``name.weight_zero_point`` packed the same way along the output
  (int32 [ceil(out * b / 32), n_groups]; older releases packed along the groups);
* ``int-quantized`` / ``naive-quantized`` (W8A8): ``name.weight`` int8 [out, in],
  ``name.weight_scale`` [out, 1], ``name.weight_zero_point`` int8 with zero points.

``W = weight_scale * (q - zero_point)`` by group (strategy ``group``: ``group_size``
columns), by row (``channel``) or for the whole tensor (``tensor``); ``q`` and the zero point
signed (-2^(b-1) .. 2^(b-1) - 1). ``name.weight_g_idx`` (activation ordering by group) must
be ``i // group_size``. Int8 weights per channel whose ``input_activations`` are int8, dynamic,
symmetric and per ``token`` (llm-compressor's W8A8) load onto the ``w8a8`` kernel, which quantizes
activations per token as they run, the scheme's own; other 8-bit weights load as q8_0 blocks,
whose kernels quantize activations per block of 32. Static activation scales (``input_scale``)
are read and not used. Refused, each by name: float
(fp8, fp4) weights or activations, bits other than 4 and 8, the ``block`` and
``tensor_group`` strategies, a permuted ``weight_g_idx``, other formats (``marlin-24``,
``nvfp4-pack-quantized``, sparse ones), KV-cache quantization and transforms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.checkpoints.compressed_tensors_save import save_compressed_tensors
from fastdecode.formats.checkpoints.int_weights import IntWeight, unpack_int32
from fastdecode.formats.checkpoints.loader import CheckpointReader
from fastdecode.formats.checkpoints.tensors import Tensors

__all__ = ["COMPRESSED_TENSORS_READER", "read_compressed_tensors_layers", "save_compressed_tensors"]

READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
STRATEGIES = ("group", "channel", "tensor")
UNUSED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")


@dataclass(frozen=True)
class Scheme:
    """One config group's weight scheme, as fastdecode reads it."""

    name: str
    targets: tuple[str, ...]
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    format: str
    activations: str | None = None  # "token": int8 activations, dynamic, symmetric, per token (IntWeight's)


def _weights_scheme(name: str, group: dict, top_format) -> Scheme:
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ConfigError(f"config group {name!r} quantizes no weights (fastdecode reads weight quantization)")
    targets = group.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"config group {name!r}: targets must be a list of strings")
    if w.get("type", "int") != "int":
        raise ConfigError(f"config group {name!r}: {w.get('type')} weights are not supported (fastdecode reads int)")
    bits, strategy = w.get("num_bits"), w.get("strategy") or ("group" if w.get("group_size") else "tensor")
    if type(bits) is not int or bits not in (4, 8):  # (4.0 == 4: a float count is refused, not carried on)
        raise ConfigError(f"config group {name!r}: num_bits={bits!r} is not supported (4 or 8)")
    if strategy not in STRATEGIES:
        raise ConfigError(f"config group {name!r}: strategy {strategy!r} is not supported ({', '.join(STRATEGIES)})")
    group_size = w.get("group_size")
    if strategy == "group" and (not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0):
        raise ConfigError(f"config group {name!r}: strategy 'group' needs a positive group_size, got {group_size!r}")
    if w.get("dynamic", False) not in (False, None):
        raise ConfigError(f"config group {name!r}: dynamic weight quantization is not supported")
    acts = group.get("input_activations")
    if acts is not None and (
        not isinstance(acts, dict) or acts.get("type", "int") != "int" or acts.get("num_bits") != 8
    ):
        raise ConfigError(f"config group {name!r}: input_activations {acts!r} are not supported (int8 or none)")
    fmt = group.get("format") or top_format
    if fmt not in READ_FORMATS:
        raise ConfigError(f"format {fmt!r} is not supported (fastdecode reads {', '.join(READ_FORMATS)})")
    per_token = acts is not None and acts.get("strategy") == "token" and acts.get("dynamic") is True
    return Scheme(
        name,
        tuple(targets),
        bits,
        bool(w.get("symmetric", True)),
        strategy,
        group_size if strategy == "group" else None,
        fmt,
        "token" if per_token and acts.get("symmetric", True) else None,
    )


def schemes(qc: dict) -> list[Scheme]:
    """The config groups of ``qc`` (a ConfigError names what fastdecode does not read)."""
    if qc.get("kv_cache_scheme"):
        raise ConfigError("kv_cache_scheme (a quantized KV cache) is not supported")
    if qc.get("transform_config"):
        raise ConfigError("transform_config (rotations such as SpinQuant or QuIP) is not supported")
    sparsity = qc.get("sparsity_config") or {}
    if not isinstance(sparsity, dict):
        raise ConfigError("quantization_config.sparsity_config must be an object")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ConfigError(f"sparsity format {sparsity.get('format')!r} is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise ConfigError("quantization_config.config_groups must be a non-empty object of schemes")
    return [_weights_scheme(name, group, qc.get("format")) for name, group in groups.items()]


def _matches(name: str, module: nn.Module, target: str) -> bool:
    if target.startswith("re:"):
        try:
            return re.match(target[3:], name) is not None
        except re.error as exc:
            raise ConfigError(
                f"quantization_config target {target!r} is not a valid regular expression: {exc}"
            ) from None
    return target in (name, type(module).__name__)


def _scales(name: str, scale: torch.Tensor, out_features: int, n_groups: int) -> torch.Tensor:
    if not scale.is_floating_point():
        raise ConfigError(f"{name}.weight_scale is {scale.dtype}, not a float tensor")
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(out_features, 1).contiguous()
    if tuple(scale.shape) != (out_features, n_groups):
        raise ConfigError(f"{name}.weight_scale is {list(scale.shape)}; expected {[out_features, n_groups]}")
    return scale.float()


def _zero_points(name: str, zp: torch.Tensor, s: Scheme, out_features: int, n_groups: int) -> torch.Tensor:
    """Signed zero points int32 [out, n_groups] from any of the layouts releases wrote."""
    offset = 1 << (s.bits - 1)
    if zp.numel() == 1:
        return zp.to(torch.int32).reshape(1, 1).expand(out_features, 1).contiguous()
    if zp.dtype == torch.int8 and tuple(zp.shape) == (out_features, n_groups):
        return zp.to(torch.int32)
    per_word = 32 // s.bits
    if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-out_features // per_word), n_groups):
        return unpack_int32(zp, s.bits, out_features, dim=0) - offset
    if zp.dtype == torch.int32 and tuple(zp.shape) == (out_features, -(-n_groups // per_word)):
        return unpack_int32(zp, s.bits, n_groups) - offset
    raise ConfigError(f"{name}.weight_zero_point is {zp.dtype} {list(zp.shape)}: not a layout fastdecode reads")


def _values(name: str, tensors: Tensors, s: Scheme, out_features: int, in_features: int) -> torch.Tensor:
    """The signed integers q, int32 [out, in]."""
    if s.format != "pack-quantized":
        q = tensors.get(f"{name}.weight")
        if q.dtype != torch.int8 or tuple(q.shape) != (out_features, in_features):
            raise ConfigError(f"{name}.weight is {q.dtype} {list(q.shape)}; {s.format} stores int8 [out, in]")
        return q.to(torch.int32)
    packed = tensors.get(f"{name}.weight_packed")
    shape = tensors.optional(f"{name}.weight_shape")
    if shape is not None and [int(v) for v in shape.flatten()] != [out_features, in_features]:
        raise ConfigError(
            f"{name}.weight_shape is {shape.tolist()}; the model's layer is {[out_features, in_features]}"
        )
    words = -(-in_features * s.bits // 32)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (out_features, words):
        raise ConfigError(
            f"{name}.weight_packed is {packed.dtype} {list(packed.shape)}; expected int32 {[out_features, words]}"
        )
    return unpack_int32(packed, s.bits, in_features) - (1 << (s.bits - 1))


def _read_layer(name: str, linear: nn.Linear, tensors: Tensors, s: Scheme) -> IntWeight:
    out_features, in_features = linear.out_features, linear.in_features
    g = s.group_size or in_features
    n_groups = -(-in_features // g)
    q = _values(name, tensors, s, out_features, in_features)
    scale = _scales(name, tensors.get(f"{name}.weight_scale"), out_features, n_groups)
    zp = tensors.optional(f"{name}.weight_zero_point")
    if s.symmetric or zp is None:
        zero = torch.zeros(out_features, n_groups, dtype=torch.int32)
    else:
        zero = _zero_points(name, zp, s, out_features, n_groups)
    g_idx = tensors.optional(f"{name}.weight_g_idx")
    if g_idx is not None and not torch.equal(g_idx.long().flatten(), torch.arange(in_features) // g):
        raise ConfigError(
            f"{name}: activation ordering with a permuted weight_g_idx is not supported: fastdecode's block "
            "kernels need each group to be consecutive input columns (use actorder 'weight' or none)"
        )
    for unused in UNUSED:
        tensors.skip(f"{name}.{unused}")
    return IntWeight(q, scale, zero, g, s.bits, s.activations)


def read_compressed_tensors_layers(qc: dict, tensors: Tensors, linears: dict[str, nn.Linear]) -> dict[str, IntWeight]:
    found = schemes(qc)
    weights = {}
    for name, linear in linears.items():
        if f"{name}.weight_scale" not in tensors:
            continue  # a float layer (ignored, or no target matched)
        scheme = next((s for s in found for t in s.targets if _matches(name, linear, t)), None)
        if scheme is None:
            raise ConfigError(f"{name} holds quantized tensors but no config group targets it")
        weights[name] = _read_layer(name, linear, tensors, scheme)
    return weights


COMPRESSED_TENSORS_READER = CheckpointReader("compressed-tensors", read_compressed_tensors_layers)
