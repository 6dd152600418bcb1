"""Quantized drop-in replacements for ``nn.Linear``, running torch's low-bit CPU kernels.

* :class:`Int8WeightOnlyLinear` calls ``aten._weight_int8pack_mm``.
* :class:`Int4WeightOnlyLinear` calls ``aten._weight_int4pack_mm_for_cpu``.
* :class:`GGUFBlockLinear` holds GGUF's block formats (Q8_0, Q4_0, Q4_1) and runs
  fastdecode's integer-dot-product kernels (``fastdecode.kernels.quant``); its
  numerics are its own (float32 activations quantized to 8-bit blocks), described
  on the class.
* :class:`W8A8Linear` holds int8 weights per output channel (float32 scales) and runs
  ``fastdecode.kernels.w8a8`` (activations quantized to int8 per token), described on the class.

torch's two kernels are fast only with bfloat16 activations (float32 activations take a
path ~10-30x slower), so ``forward`` casts the input to bfloat16 and the output
back to the input's dtype; scales (and zeros) are stored in bfloat16 for the
same reason. The weights are never dequantized on the forward path.

The int4 kernel's packed layout depends on the CPU the process runs on (blocks of
64 output rows interleaved on AVX-512, 32 on AVX2, plain nibble pairs otherwise),
so the state dict holds a portable layout instead: ``qweight`` uint8 [out, in/2],
byte j of a row = q[2j] | q[2j+1] << 4. The kernel layout lives in a
non-persistent buffer, rebuilt on load and unpacked on save.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import fastdecode.quant.math as qmath
from fastdecode.errors import ConfigError
from fastdecode.kernels.gguf_blocks import FORMATS, QK, BlockTensor
from fastdecode.kernels.quant import Projection, block_linear_reference, kernel_unavailable, pack
from fastdecode.kernels.w8a8 import pack_w8a8, w8a8_linear_reference

# The CPU int4 kernel ignores innerKTiles' tiling but still checks it is 2, 4 or 8.
_INNER_K_TILES = 2
# The CPU int4 packer processes output rows in blocks of 16.
_INT4_OUT_MULTIPLE = 16
# torch's CPU int8 kernel reads the input dimension 16 at a time without a tail
# loop: other sizes give wrong results or crash (seen on torch 2.13, AVX-512).
_INT8_IN_MULTIPLE = 16
_KERNEL_DTYPE = torch.bfloat16


def _module_bytes(module: nn.Module) -> int:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors)


def _float_bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)


def _check_cpu(x: torch.Tensor, name: str) -> None:
    if x.device.type != "cpu":
        raise ConfigError(f"{name} runs torch's CPU low-bit kernel; got input on {x.device}")


class Int8WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W stored as int8 per output channel (symmetric)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        check_int8_shape(in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=_KERNEL_DTYPE))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_quantized(
        cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> Int8WeightOnlyLinear:
        """From :func:`~fastdecode.quant.math.quantize_int8_per_channel`'s (q [out, in], scales [out])."""
        out_features, in_features = q.shape
        if q.dtype != torch.int8 or scales.shape != (out_features,):
            raise ConfigError(
                f"int8 weight needs q int8 [out, in] and scales [out]; got {q.dtype} {tuple(q.shape)}, {tuple(scales.shape)}"
            )
        module = cls(in_features, out_features, bias=False)
        module.qweight = q.detach().contiguous().cpu()
        module.scales = scales.detach().to(_KERNEL_DTYPE).contiguous().cpu()
        module.bias = _float_bias(bias)
        return module

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        q, scales = qmath.quantize_int8_per_channel(linear.weight)
        return cls.from_quantized(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        _check_cpu(x, type(self).__name__)
        x2 = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)  # [M, in]
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)  # [M, out]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, float32 [out, in] (for tests and analysis)."""
        return qmath.dequantize_int8_per_channel(self.qweight, self.scales)

    def weight_bytes(self) -> int:
        return _module_bytes(self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4WeightOnlyLinear(nn.Module):
    """y = x W^T + b with W stored as 4-bit groups of ``group_size`` input columns.

    Buffers: ``packed`` (kernel layout, not saved), ``scales_and_zeros`` bf16
    [in/g, out, 2] (the kernel's layout: [..., 0] scale, [..., 1] zero, with
    W = (q - 8) * scale + zero). The saved ``qweight`` is the portable layout
    described in the module docstring.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 32,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        check_int4_shape(in_features, out_features, group_size)
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        q = torch.full((out_features, in_features), qmath.INT4_MID, dtype=torch.uint8)
        self.register_buffer("packed", _pack_for_kernel(q), persistent=False)
        self.register_buffer(
            "scales_and_zeros",
            torch.zeros(in_features // group_size, out_features, 2, dtype=_KERNEL_DTYPE),
        )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_quantized(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> Int4WeightOnlyLinear:
        """From :func:`~fastdecode.quant.math.quantize_int4_groupwise`'s
        (q uint8 0..15 [out, in], scales [out, in/g], zeros [out, in/g])."""
        out_features, in_features = q.shape
        module = cls(in_features, out_features, bias=False, group_size=group_size)
        expected = (out_features, in_features // group_size)
        if scales.shape != expected or zeros.shape != expected:
            raise ConfigError(f"int4 scales/zeros must be {expected}; got {tuple(scales.shape)}, {tuple(zeros.shape)}")
        module.packed = _pack_for_kernel(q.detach().cpu())
        module.scales_and_zeros = (
            torch.stack([scales.detach().float(), zeros.detach().float()], dim=-1)  # [out, in/g, 2]
            .transpose(0, 1)
            .to(_KERNEL_DTYPE)
            .contiguous()
            .cpu()
        )
        module.bias = _float_bias(bias)
        return module

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = 32) -> Int4WeightOnlyLinear:
        check_int4_shape(linear.in_features, linear.out_features, group_size)
        q, scales, zeros = qmath.quantize_int4_groupwise(linear.weight, group_size)
        return cls.from_quantized(q, scales, zeros, group_size, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        _check_cpu(x, type(self).__name__)
        x2 = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE)  # [M, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_and_zeros
        )  # [M, out]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def unpacked(self) -> torch.Tensor:
        """The 4-bit values, uint8 0..15 [out, in]."""
        return _unpack_from_kernel(self.packed, self.in_features, self.out_features, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The weight the kernel multiplies by, float32 [out, in] (for tests and analysis)."""
        sz = self.scales_and_zeros.transpose(0, 1)  # [out, in/g, 2]
        return qmath.dequantize_int4_groupwise(self.unpacked(), sz[..., 0], sz[..., 1], self.group_size)

    def weight_bytes(self) -> int:
        return _module_bytes(self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}"
        )

    # The state dict carries the portable `qweight`, never the CPU-specific `packed`.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "qweight"] = _to_portable(self.unpacked())

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "qweight"
        if key in state_dict:
            portable = state_dict[key]
            expected = (self.out_features, self.in_features // 2)
            if portable.dtype != torch.uint8 or tuple(portable.shape) != expected:
                error_msgs.append(f"{key}: expected uint8 {expected}, got {portable.dtype} {tuple(portable.shape)}")
            else:
                self.packed = _pack_for_kernel(_from_portable(portable))
        elif strict:
            missing_keys.append(key)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


class PackedProjectionLinear(nn.Module):
    """The lifecycle of a layer run by the C kernels' packed :class:`Projection` (GGUFBlockLinear,
    W8A8Linear): the packed copy built on the first forward (the torch reference where the kernels
    do not build), dropped after a load or a move and never copied, and a load that refuses a
    buffer of another dtype (``_buffer_dtypes``) instead of casting it silently. A subclass gives
    :meth:`_packed` and :meth:`_reference`, and may check a loaded state in :meth:`_check_state`."""

    _buffer_dtypes: tuple[tuple[str, torch.dtype, str], ...] = ()  # (buffer, dtype, what it holds)

    def _packed(self):
        raise NotImplementedError

    def _reference(self, x32: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _check_state(self, state_dict: dict, prefix: str, error_msgs: list) -> dict:
        return state_dict

    def float_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.detach().to(torch.float32).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        _check_cpu(x, type(self).__name__)
        x32 = x.to(torch.float32)
        if self._projection is None and kernel_unavailable() is None:
            self._projection = Projection([self._packed()], self.float_bias(), self.in_features)
        y = self._projection(x32) if self._projection is not None else self._reference(x32)
        return y.to(x.dtype)

    def weight_bytes(self) -> int:
        return _module_bytes(self)

    # The packed copy follows the weights: rebuilt after a load or a move, never copied.
    def _apply(self, fn, *args, **kwargs):
        self._projection = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        return {**super().__getstate__(), "_projection": None}  # ctypes structures do not copy

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        self._projection = None
        for name, dtype, what in self._buffer_dtypes:
            key = prefix + name
            if key in state_dict and state_dict[key].dtype != dtype:  # a plain buffer load would cast silently
                error_msgs.append(f"{key}: expected {what}, got {state_dict[key].dtype}")
                state_dict = {k: v for k, v in state_dict.items() if k != key}
        state_dict = self._check_state(state_dict, prefix, error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class GGUFBlockLinear(PackedProjectionLinear):
    """y = x W^T + b with W in one of GGUF's block formats (``fastdecode.kernels.gguf_blocks``:
    Q8_0, Q4_0, Q4_1; blocks of 32 weights of a row, each with an fp16 scale).

    The numeric model is that of ``--weights q8_0|q4_0|q4_1`` on the native backend
    (``fastdecode.kernels.quant``): each row of x quantized to 8-bit blocks in float32,
    integer dot products, the blocks' terms summed in order, the bias added in float32.
    A row's result does not depend on the other rows. ``forward`` runs the C kernels
    where they build and their torch reference elsewhere (the same bits), and returns
    the input's dtype.

    Buffer ``blocks``: uint8 [out, ceil(in / 32) * block_bytes], the blocks as ggml
    lays them out, saved as they are (a round trip is lossless).
    """

    _buffer_dtypes = (("blocks", torch.uint8, "uint8 block bytes"),)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        format: str = "q4_0",
    ) -> None:
        super().__init__()
        if format not in FORMATS:
            raise ConfigError(f"unknown block format {format!r}; choose one of {', '.join(FORMATS)}")
        self.in_features = in_features
        self.out_features = out_features
        self.format = format
        row_bytes = -(-in_features // QK) * FORMATS[format].block_bytes
        self.register_buffer("blocks", torch.zeros(out_features, row_bytes, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._projection = None  # the kernels' packed copy, built on the first forward

    @classmethod
    def from_block_tensor(cls, weight: BlockTensor, bias: torch.Tensor | None = None) -> GGUFBlockLinear:
        """From a :class:`~fastdecode.kernels.gguf_blocks.BlockTensor` [out, in] (its bytes copied)."""
        module = cls(weight.cols, weight.rows, bias=False, format=weight.format.name)
        module.blocks = torch.from_numpy(np.array(weight.blocks, dtype=np.uint8, copy=True))
        module.bias = _float_bias(bias)
        return module

    @classmethod
    def from_float(cls, linear: nn.Linear, format: str) -> GGUFBlockLinear:
        """``linear``'s weight with ggml's rounding (``BlockTensor.quantize``, as ``--weights`` does it)."""
        if format not in FORMATS:
            raise ConfigError(f"unknown block format {format!r}; choose one of {', '.join(FORMATS)}")
        return cls.from_block_tensor(BlockTensor.quantize(linear.weight, format), linear.bias)

    def block_tensor(self) -> BlockTensor:
        """The weight as a :class:`~fastdecode.kernels.gguf_blocks.BlockTensor` (a view of ``blocks``, no copy)."""
        return BlockTensor(FORMATS[self.format], self.blocks.numpy(), self.in_features)

    def _packed(self):
        return pack(self.block_tensor())

    def _reference(self, x32: torch.Tensor) -> torch.Tensor:
        return block_linear_reference(x32, [self.block_tensor()], self.bias)

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 [out, in] (for tests and analysis; the forward never builds it)."""
        return self.block_tensor().dequantize()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format}"
        )


class W8A8Linear(PackedProjectionLinear):
    """y = x W^T + b, W8A8: W int8 per output channel with float32 scales (symmetric), each row of
    x quantized to int8 with one scale (per token, dynamic), the products summed exactly in int32
    over the whole row and scaled by ``scales[n] * dx[m]`` (``fastdecode.kernels.w8a8``), the bias
    added in float32. The numeric model of ``--weights w8a8`` on the native backend, bit for bit;
    a row's result does not depend on the other rows. ``forward`` runs the C kernels where they
    build and their torch reference elsewhere (the same bits), and returns the input's dtype.

    Buffers: ``qweight`` int8 [out, in], ``scales`` float32 [out]."""

    _buffer_dtypes = (("qweight", torch.int8, "torch.int8"), ("scales", torch.float32, "torch.float32"))

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._projection = None  # the kernels' packed copy, built on the first forward

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> W8A8Linear:
        """From int8 q [out, in] and float32 scales [out] (copied)."""
        if q.dtype != torch.int8 or q.dim() != 2 or tuple(scales.shape) != (q.shape[0],):
            raise ConfigError(
                f"W8A8 weight needs q int8 [out, in] and scales [out]; got {q.dtype} {tuple(q.shape)}, "
                f"{tuple(scales.shape)}"
            )
        module = cls(q.shape[1], q.shape[0], bias=False)
        module.qweight = q.detach().contiguous().cpu().clone()
        module.scales = scales.detach().to(torch.float32).contiguous().cpu().clone()
        module.bias = _float_bias(bias)
        return module

    @classmethod
    def from_float(cls, linear: nn.Linear) -> W8A8Linear:
        """``linear``'s weight rounded to nearest against float32 per-row scales (as ``--weights w8a8`` does it)."""
        q, scales = qmath.quantize_int8_per_channel(linear.weight, float32_scales=True)
        return cls.from_quantized(q, scales, linear.bias)

    def _packed(self):
        return pack_w8a8(self.qweight, self.scales)

    def _reference(self, x32: torch.Tensor) -> torch.Tensor:
        return w8a8_linear_reference(x32, self.qweight, self.scales, self.bias)

    def _check_state(self, state_dict: dict, prefix: str, error_msgs: list) -> dict:
        key = prefix + "scales"
        if key in state_dict and not bool(torch.isfinite(state_dict[key]).all()):  # a corrupt file: NaN outputs
            error_msgs.append(f"{key}: the scales must be finite")
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        return state_dict

    def dequantize(self) -> torch.Tensor:
        """The weight's values, float32 [out, in] (for tests and analysis; the forward never builds it)."""
        return qmath.dequantize_int8_per_channel(self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def check_int8_shape(in_features: int, out_features: int) -> None:
    """ConfigError unless torch's CPU int8 kernel accepts this layer shape."""
    if in_features % _INT8_IN_MULTIPLE:
        raise ConfigError(f"int8 kernel needs in_features divisible by {_INT8_IN_MULTIPLE}, got {in_features}")


def check_int4_shape(in_features: int, out_features: int, group_size: int) -> None:
    """ConfigError unless torch's CPU int4 kernel accepts this layer shape."""
    qmath.check_group_size(in_features, group_size)
    if out_features % _INT4_OUT_MULTIPLE:
        raise ConfigError(f"int4 kernel needs out_features divisible by {_INT4_OUT_MULTIPLE}, got {out_features}")


def int4_group_size_for(in_features: int, out_features: int, preferred: int) -> int | None:
    """``preferred`` if the kernel accepts it for this shape, else the largest smaller
    supported group size that divides ``in_features``; None if there is none."""
    if out_features % _INT4_OUT_MULTIPLE:
        return None
    for g in sorted(qmath.INT4_GROUP_SIZES, reverse=True):
        if g <= preferred and in_features % g == 0:
            return g
    return None


def _pack_for_kernel(q: torch.Tensor) -> torch.Tensor:
    """uint8 0..15 [out, in] -> the CPU kernel's packed uint8 [out, in/2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)


def _unpack_from_kernel(packed: torch.Tensor, in_features: int, out_features: int, group_size: int) -> torch.Tensor:
    """Inverse of :func:`_pack_for_kernel`, whatever layout this CPU's kernel uses.

    Multiplies the identity by the packed weight with scale 1 and zero 8, so the
    kernel's own dequantization returns (q - 8) * 1 + 8 = q; small integers and a
    single nonzero term per output are exact in bfloat16.
    """
    unit = torch.empty(in_features // group_size, out_features, 2, dtype=_KERNEL_DTYPE)
    unit[..., 0] = 1.0
    unit[..., 1] = float(qmath.INT4_MID)
    q_t = torch.empty(in_features, out_features, dtype=torch.uint8)  # q^T: [in, out]
    chunk = 256
    for start in range(0, in_features, chunk):
        stop = min(start + chunk, in_features)
        eye_rows = torch.zeros(stop - start, in_features, dtype=_KERNEL_DTYPE)  # [c, in]
        eye_rows[:, start:stop] = torch.eye(stop - start, dtype=_KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(eye_rows, packed, group_size, unit)  # [c, out]
        q_t[start:stop] = y.round().to(torch.uint8)
    return q_t.T.contiguous()


def _to_portable(q: torch.Tensor) -> torch.Tensor:
    """uint8 0..15 [out, in] -> uint8 [out, in/2], low nibble = even column."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _from_portable(portable: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> uint8 0..15 [out, in]."""
    return torch.stack([portable & 0x0F, portable >> 4], dim=-1).reshape(portable.shape[0], -1)
