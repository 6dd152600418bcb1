"""AutoAWQ checkpoints (``quant_method: "awq"``, ``version: "gemm"``).

A quantized linear layer ``name`` [out, in] in groups of ``g`` input columns is stored as
(AutoAWQ's ``WQLinear_GEMM``; transformers' ``AwqConfig`` keys ``bits``, ``group_size``,
``zero_point``, ``version``, or AutoAWQ's own ``w_bit``, ``q_group_size``)::

    name.qweight  int32 [in, out / 8]      8 nibbles a word along the output, in AWQ's order
    name.qzeros   int32 [in / g, out / 8]  the zero points, packed the same way
    name.scales   fp16  [in / g, out]
    name.bias     fp16  [out]              where the layer has one

AWQ's order: nibble ``k`` (bits ``4 k``) of a word holds output column ``AWQ_ORDER[k]`` of
its eight, ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``. The weight is
``W[o, i] = scales[i // g, o] * (q[i, o] - zeros[i // g, o])``, q and zeros in 0..15: 4-bit
groups with zero points, which run as q4_1 (or q4_0 where every zero point is 8).
"""

from __future__ import annotations

import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.formats.checkpoints.int_weights import IntWeight, pack_int32, unpack_int32
from fastdecode.formats.checkpoints.loader import CheckpointReader
from fastdecode.formats.checkpoints.tensors import Tensors

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_ORDER[k] of its eight
AWQ_VERSIONS = ("gemm",)


def awq_settings(qc: dict) -> tuple[int, int | None]:
    """(bits, group size or None for one group a row) from ``qc``; unsupported variants: ConfigError."""
    bits = qc.get("bits", qc.get("w_bit", 4))
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise ConfigError(
            f"AWQ version {version!r} is not supported (fastdecode reads the GEMM layout, version 'gemm')"
        )
    if type(bits) is not int or bits != 4:
        raise ConfigError(f"AWQ with bits={bits!r}: the GEMM layout fastdecode reads is 4-bit")
    if qc.get("zero_point", True) is not True:
        raise ConfigError("AWQ with zero_point false: the GEMM layout fastdecode reads stores zero points")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size == 0 or group_size < -1:
        raise ConfigError(f"AWQ group_size must be a positive integer or -1, got {group_size!r}")
    return bits, (None if group_size == -1 else group_size)


def _unpack_awq(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """int32 [rows, columns / 8] in AWQ's order -> int32 0..15 [rows, columns]."""
    fields = unpack_int32(packed, 4, packed.shape[1] * 8).view(packed.shape[0], -1, 8)  # nibble k
    natural = torch.empty_like(fields)
    natural[..., list(AWQ_ORDER)] = fields  # column AWQ_ORDER[k] is nibble k
    return natural.reshape(packed.shape[0], -1)[:, :columns]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int 0..15 [rows, columns] (columns % 8 == 0) -> int32 [rows, columns / 8] in AWQ's order."""
    rows = values.shape[0]
    grouped = values.reshape(rows, -1, 8)[..., list(AWQ_ORDER)]  # nibble k takes column AWQ_ORDER[k]
    return pack_int32(grouped.reshape(rows, -1), 4)


def _read_layer(name: str, linear: nn.Linear, tensors: Tensors, group: int | None) -> IntWeight:
    out_features, in_features = linear.out_features, linear.in_features
    g = group or in_features
    n_groups = -(-in_features // g)
    qweight, qzeros = tensors.get(f"{name}.qweight"), tensors.get(f"{name}.qzeros")
    scales = tensors.get(f"{name}.scales")
    expected = {
        "qweight": (qweight, torch.int32, (in_features, -(-out_features // 8))),
        "qzeros": (qzeros, torch.int32, (n_groups, -(-out_features // 8))),
        "scales": (scales, None, (n_groups, out_features)),
    }
    for what, (t, dtype, shape) in expected.items():
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
            raise ConfigError(
                f"{name}.{what} is {t.dtype} {list(t.shape)}; a [{out_features}, {in_features}] layer in groups "
                f"of {g} stores {dtype or 'a float'} {list(shape)}"
            )
    if not scales.is_floating_point():
        raise ConfigError(f"{name}.scales is {scales.dtype}, not a float tensor")
    q = _unpack_awq(qweight, out_features).T.contiguous()  # [out, in]
    zero = _unpack_awq(qzeros, out_features).T.contiguous()  # [out, n_groups]
    return IntWeight(q, scales.T.float().contiguous(), zero, g, 4)


def read_awq_layers(qc: dict, tensors: Tensors, linears: dict[str, nn.Linear]) -> dict[str, IntWeight]:
    _, group = awq_settings(qc)
    return {
        name: _read_layer(name, linear, tensors, group)
        for name, linear in linears.items()
        if f"{name}.qweight" in tensors
    }


AWQ_READER = CheckpointReader("awq", read_awq_layers)
