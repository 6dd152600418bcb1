"""GPTQ checkpoints as AutoGPTQ and GPTQModel write them (``quant_method: "gptq"``).

A quantized linear layer ``name`` [out, in] of ``b`` bits (4 or 8 here; ``32 / b`` values a
word) in groups of ``g`` input columns (``group_size``; -1: one group a row)::

    name.qweight  int32 [in * b / 32, out]        packed along the input: value k of word r
                                                  (bits k * b) is input row r * 32 / b + k
    name.qzeros   int32 [in / g, out * b / 32]    packed along the output the same way
    name.scales   fp16  [in / g, out]
    name.g_idx    int32 [in]                      the group of each input row
    name.bias     fp16  [out]                     where the layer has one

``W[o, i] = scales[g_idx[i], o] * (q[i, o] - z[g_idx[i], o])`` with ``z`` the stored zero
plus one for ``checkpoint_format`` ``gptq`` (AutoGPTQ's v1 layout, the default) and as
stored for ``gptq_v2``. A ``g_idx`` other than ``i // g`` (act-order, ``desc_act``, with a
permutation) puts the columns of one block of 32 in different groups: no block kernel
holds that, and it is refused, as are other bit widths, ``pack_dtype`` other than int32
and the kernel-specific layouts (``marlin``, ``bitblas``, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.checkpoints.int_weights import IntWeight, unpack_int32
from fastdecode.formats.checkpoints.loader import CheckpointReader
from fastdecode.formats.checkpoints.tensors import Tensors

GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")


def gptq_settings(qc: dict) -> tuple[int, int | None, bool]:
    """(bits, group size or None, v1 zero points) from ``qc``; unsupported variants: ConfigError."""
    bits = qc.get("bits", 4)
    group_size = qc.get("group_size", 128)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if type(bits) is not int or bits not in GPTQ_BITS:
        raise ConfigError(f"GPTQ with bits={bits!r} is not supported (fastdecode's kernels take 4- and 8-bit weights)")
    if fmt not in GPTQ_FORMATS:
        raise ConfigError(
            f"GPTQ checkpoint_format {fmt!r} is not supported (fastdecode reads {', '.join(GPTQ_FORMATS)})"
        )
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ConfigError(f"GPTQ pack_dtype {qc['pack_dtype']!r} is not supported (fastdecode reads int32 packing)")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size == 0 or group_size < -1:
        raise ConfigError(f"GPTQ group_size must be a positive integer or -1, got {group_size!r}")
    return bits, (None if group_size == -1 else group_size), fmt == "gptq"


def _check(name: str, what: str, t: torch.Tensor, dtype: torch.dtype | None, shape: tuple) -> None:
    if (
        tuple(t.shape) != shape
        or (dtype is not None and t.dtype != dtype)
        or (dtype is None and not t.is_floating_point())
    ):
        raise ConfigError(f"{name}.{what} is {t.dtype} {list(t.shape)}; expected {dtype or 'a float'} {list(shape)}")


def _check_g_idx(name: str, g_idx: torch.Tensor | None, in_features: int, g: int, desc_act: bool) -> None:
    if g_idx is None:
        return
    _check(name, "g_idx", g_idx, None if g_idx.is_floating_point() else g_idx.dtype, (in_features,))
    if not torch.equal(g_idx.long(), torch.arange(in_features) // g):
        raise ConfigError(
            f"{name}: act-order GPTQ (desc_act={desc_act}) with a permuted g_idx is not supported: fastdecode's "
            "block kernels need each group to be consecutive input columns; quantize with desc_act=False"
        )


def _read_layer(name: str, linear: nn.Linear, tensors: Tensors, settings: tuple, desc_act: bool) -> IntWeight:
    bits, group, v1 = settings
    out_features, in_features = linear.out_features, linear.in_features
    g = group or in_features
    n_groups, per_word = -(-in_features // g), 32 // bits
    qweight, qzeros = tensors.get(f"{name}.qweight"), tensors.get(f"{name}.qzeros")
    scales = tensors.get(f"{name}.scales")
    _check(name, "qweight", qweight, torch.int32, (-(-in_features // per_word), out_features))
    _check(name, "qzeros", qzeros, torch.int32, (n_groups, -(-out_features // per_word)))
    _check(name, "scales", scales, None, (n_groups, out_features))
    _check_g_idx(name, tensors.optional(f"{name}.g_idx"), in_features, g, desc_act)
    q = unpack_int32(qweight, bits, in_features, dim=0).T.contiguous()  # [out, in]
    zero = unpack_int32(qzeros, bits, out_features).T.contiguous() + (1 if v1 else 0)  # [out, n_groups]
    return IntWeight(q, scales.T.float().contiguous(), zero, g, bits)


def read_gptq_layers(qc: dict, tensors: Tensors, linears: dict[str, nn.Linear]) -> dict[str, IntWeight]:
    settings = gptq_settings(qc)
    desc_act = bool(qc.get("desc_act", False))
    return {
        name: _read_layer(name, linear, tensors, settings, desc_act)
        for name, linear in linears.items()
        if f"{name}.qweight" in tensors
    }


GPTQ_READER = CheckpointReader("gptq", read_gptq_layers)
