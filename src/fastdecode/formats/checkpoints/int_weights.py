"""A linear layer's integer weight as other tools store it, and the module fastdecode runs it on.

Every checkpoint family here (compressed-tensors, AutoAWQ, GPTQ) stores a linear layer as
integers in groups of input columns with one scale (and zero point) per group::

    W[o, i] = scale[o, i // g] * (q[o, i] - zero[o, i // g])        (:class:`IntWeight`)

:func:`to_module` puts that weight on fastdecode's block kernels (``fastdecode.kernels.gguf_blocks``)
without passing through float, whenever a block of 32 columns lies in one group (``g`` a
multiple of 32, or one group a row) and ``in_features`` is a multiple of 32:

* 4 bits, ``q - zero + 8`` in 0..15 everywhere (symmetric): **q4_0**, ``d * (u - 8)`` with
  ``d = scale`` and ``u = q - zero + 8``; exact where the scales are fp16 values;
* 4 bits otherwise (zero points): **q4_1**, ``d * u + m`` with ``u = q - lo`` (``lo`` the
  stored range's low end, 0 or -8), ``d = scale``, ``m = -scale * (zero - lo)`` rounded to
  fp16. ``m`` is a multiple of the scale up to 16 times it, so its rounding moves a weight
  by at most 2^-11 * |m| <= 2^-7 of one quantization step (``scale``); :class:`Conversion`
  records the largest such error seen;
* 8 bits, ``q - zero`` in int8's range: **q8_0**, ``d * v`` with ``v = q - zero``; but one group
  a row (per channel) whose checkpoint quantizes activations per token (``activations="token"``,
  llm-compressor's W8A8): **w8a8** (:class:`~fastdecode.quant.linear.W8A8Linear`), ``v`` and the
  row's scale in float32 (exact), activations per token as the checkpoint's scheme has them.

A scale that is not an fp16 value is rounded to one (relative error at most 2^-11, also
recorded). Anything else (a group size that is no multiple of 32, a row length that is no
multiple of 32, scales outside fp16's range, an asymmetric int8 weight whose ``q - zero``
leaves int8) is dequantized to a float ``nn.Linear``, and the conversion's note says which
layers and why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fastdecode.errors import ConfigError
from fastdecode.kernels.gguf_blocks import FORMATS, QK, BlockTensor
from fastdecode.quant.linear import GGUFBlockLinear, W8A8Linear

FP16_STEP = 2.0**-11  # fp16's relative rounding error (half an ulp at 1.0)


@dataclass(frozen=True)
class IntWeight:
    """One layer's integer weight: ``W = scale[:, i // g] * (q - zero[:, i // g])``.

    q: int32 [out, in]; scale: float [out, n_groups]; zero: int32 [out, n_groups];
    group_size: g (``in_features`` for one group a row); bits: 4 or 8; activations: "token" where
    the checkpoint quantizes activations to int8 per token at run time, else None."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    bits: int
    activations: str | None = None

    def __post_init__(self) -> None:
        out_features, in_features = self.q.shape
        n_groups = -(-in_features // self.group_size)
        for what, t in (("scale", self.scale), ("zero", self.zero)):
            if tuple(t.shape) != (out_features, n_groups):
                raise ConfigError(
                    f"{what} is {tuple(t.shape)}; a [{out_features}, {in_features}] weight in groups of "
                    f"{self.group_size} needs [{out_features}, {n_groups}]"
                )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def _group_of_column(self) -> torch.Tensor:  # [in]
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 [out, in] (the reference a loaded layer is measured against)."""
        idx = self._group_of_column()
        return self.scale.float()[:, idx] * (self.q - self.zero[:, idx]).float()


@dataclass
class Conversion:
    """What :func:`to_module` did to one model's layers: counts by the numeric model each
    runs, the layers dequantized to float and why, the largest scale and q4_1 minimum
    rounding errors (in units of one quantization step)."""

    counts: Counter = field(default_factory=Counter)
    floats: list[str] = field(default_factory=list)
    scale_rounding: float = 0.0
    min_rounding: float = 0.0

    @property
    def weights(self) -> str:
        return "+".join(k for k, _ in self.counts.most_common())

    @property
    def note(self) -> str:
        parts = [f"layers: {self.weights or 'none quantized'}"]
        if self.floats:
            parts.append(f"{len(self.floats)} dequantized to float (first: {self.floats[0]})")
        if self.scale_rounding:
            parts.append(f"scales rounded to fp16 (at most {self.scale_rounding:.2e} of a step)")
        if self.min_rounding:
            parts.append(f"q4_1 minimums rounded to fp16 (at most {self.min_rounding:.2e} of a step)")
        return "; ".join(parts)


def to_module(name: str, weight: IntWeight, bias: torch.Tensor | None, conversion: Conversion) -> nn.Module:
    """``weight`` as a :class:`W8A8Linear` or :class:`GGUFBlockLinear` (q4_0, q4_1 or q8_0) where the
    mapping in the module docstring applies, else a float ``nn.Linear`` of its dequantized values."""
    out_features, in_features = weight.shape
    w8a8 = _w8a8_module(weight, bias)
    if w8a8 is not None:
        conversion.counts["w8a8"] += 1
        return w8a8
    why = _why_not_blocks(weight)
    if why is None:
        d16 = weight.scale.to(torch.float16)
        bad = ~torch.isfinite(d16) | ((d16 == 0) & (weight.scale != 0))
        if bool(bad.any()):
            why = "scales outside fp16's range"
    if why is None:
        blocks, fmt = _blocks(weight, d16, conversion)
        if blocks is not None:
            conversion.counts[fmt] += 1
            return GGUFBlockLinear.from_block_tensor(blocks, bias)
        why = fmt
    conversion.counts["float"] += 1
    conversion.floats.append(f"{name}: {why}")
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.dequantize(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    return linear


def _w8a8_module(weight: IntWeight, bias: torch.Tensor | None) -> W8A8Linear | None:
    """Per-channel int8 with per-token activations as a W8A8 layer (None where it is not that, or
    ``q - zero`` leaves int8's range, or a scale is not finite: the block mapping then decides)."""
    if weight.activations != "token" or weight.bits != 8 or weight.scale.shape[1] != 1:
        return None
    centred = weight.q - weight.zero  # [out, in] - [out, 1]
    scale = weight.scale[:, 0].to(torch.float32)
    if int(centred.min()) < -128 or int(centred.max()) > 127 or not bool(torch.isfinite(scale).all()):
        return None
    return W8A8Linear.from_quantized(centred.to(torch.int8), scale, bias)


def _why_not_blocks(weight: IntWeight) -> str | None:
    in_features = weight.shape[1]
    if weight.bits not in (4, 8):
        return f"{weight.bits}-bit weights"
    if in_features % QK:
        return f"in_features {in_features} is not a multiple of {QK}"
    if weight.group_size != in_features and weight.group_size % QK:
        return f"group size {weight.group_size} is not a multiple of {QK}"
    return None


def _blocks(weight: IntWeight, d16: torch.Tensor, conversion: Conversion) -> tuple[BlockTensor | None, str]:
    """(the blocks, their format) or (None, why not)."""
    scale = weight.scale.double()
    step = torch.where(scale == 0, torch.ones_like(scale), scale.abs())
    zero = weight.zero[:, weight._group_of_column()]  # [out, in]
    centred = weight.q - zero
    m16 = None
    if weight.bits == 8:
        if int(centred.min()) < -128 or int(centred.max()) > 127:
            return None, "asymmetric int8 whose q - zero leaves int8's range"
        fmt, values = "q8_0", centred
    elif int(centred.min()) >= -8 and int(centred.max()) <= 7:
        fmt, values = "q4_0", centred + 8
    else:
        lo = 0 if int(weight.q.min()) >= 0 else -8
        values = weight.q - lo
        if int(values.min()) < 0 or int(values.max()) > 15:
            return None, "4-bit values outside 0..15"
        m_exact = -scale * (weight.zero - lo).double()  # [out, n_groups]
        m16 = m_exact.to(torch.float16)
        if not bool(torch.isfinite(m16).all()):
            return None, "q4_1 minimums outside fp16's range"
        err = ((m16.double() - m_exact).abs() / step).max()
        conversion.min_rounding = max(conversion.min_rounding, float(err))
        fmt = "q4_1"
    err = ((d16.double() - scale).abs() / step).max()
    conversion.scale_rounding = max(conversion.scale_rounding, float(err))
    return pack_blocks(values, d16, m16, weight.group_size, fmt), fmt


def pack_blocks(
    values: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor | None, group_size: int, fmt: str
) -> BlockTensor:
    """GGUF blocks of 32 from integers and per-group fp16 scales (and minimums).

    values: [out, in], in % 32 == 0: uint 0..15 (q4_0, q4_1) or int8 (q8_0);
    d16, m16: fp16 [out, n_groups], each block taking its group's."""
    rows, cols = values.shape
    nb = cols // QK
    group_of_block = torch.arange(nb) * QK // group_size  # [nb]
    pieces = [d16[:, group_of_block].contiguous().view(torch.uint8).view(rows, nb, 2)]
    if m16 is not None:
        pieces.append(m16[:, group_of_block].contiguous().view(torch.uint8).view(rows, nb, 2))
    v = values.view(rows, nb, QK)
    if FORMATS[fmt].nibbles:
        v = v.to(torch.uint8)
        q = v[..., :16] | (v[..., 16:] << 4)  # byte i: weight i low, weight 16 + i high
    else:
        q = v.to(torch.int8).view(torch.uint8)
    blocks = torch.cat([*pieces, q], dim=-1).reshape(rows, nb * FORMATS[fmt].block_bytes)
    return BlockTensor(FORMATS[fmt], np.ascontiguousarray(blocks.numpy()), cols)


def unpack_int32(packed: torch.Tensor, bits: int, count: int, dim: int = 1) -> torch.Tensor:
    """Unsigned ``bits``-bit fields packed into int32 words along ``dim``, element ``k`` of a
    word at bits ``k * bits`` (the order compressed-tensors and GPTQ use), as int32 with
    ``count`` elements along ``dim``. bits: a divisor of 32."""
    if packed.dtype != torch.int32:
        raise ConfigError(f"packed weights must be int32, got {packed.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed if dim == 1 else packed.T
    fields = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    out = fields.reshape(p.shape[0], p.shape[1] * per_word)
    if out.shape[1] < count:
        raise ConfigError(f"packed tensor holds {out.shape[1]} values along dim {dim}, need {count}")
    out = out[:, :count]
    return out if dim == 1 else out.T.contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`unpack_int32`: unsigned ``bits``-bit values [.., n] -> int32 words
    (n padded with zeros to a whole word)."""
    per_word = 32 // bits
    v = (values if dim == 1 else values.T).to(torch.int64)
    pad = (-v.shape[1]) % per_word
    v = torch.nn.functional.pad(v, (0, pad)).view(v.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 1 else words.T.contiguous()
