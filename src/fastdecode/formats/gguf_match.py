"""A float model's weights matched to a GGUF file's own blocks (``--weights gguf`` on a model
loaded in float, ``lazy=False``): the file's tensor table comes from the validated reader
(:class:`~fastdecode.loaders.gguf_file.GGUFFile`), the blocks are memory-mapped as stored, and a
tensor is taken only in a row order under which it dequantizes to exactly the model's weight.
A model loaded lazily from its GGUF file does not need this: its layers carry their tensors."""

from __future__ import annotations

import numpy as np
import torch

from fastdecode.kernels.gguf_blocks import (
    BlockRows,
    BlockTensor,
    file_blocks,
    format_of_ggml_type,
    gguf_tensor_names,
    llama_unpermute,
)
from fastdecode.loaders.gguf_file import GGUFFile


class GGUFBlocks:
    """The tensors of one ``.gguf`` file, and which of them a model's modules can take."""

    def __init__(self, path: str) -> None:
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.architecture = self.file.architecture

    def type_name(self, name: str) -> str | None:
        t = self.file.tensors.get(name)
        return None if t is None else t.type_name.lower()

    def blocks(self, name: str) -> BlockTensor | None:
        """Tensor ``name`` as stored (file row order, memory-mapped: :func:`file_blocks`), or None when
        absent, float (F32 / F16 / BF16 take the float path) or of a type fastdecode does not run."""
        t = self.file.tensors.get(name)
        fmt = None if t is None else format_of_ggml_type(t.ggml_type)
        if fmt is None or fmt.is_float:
            return None
        return file_blocks(t.ggml_type, self.file.rows(name), t.cols)

    # A wrong row order or tensor shows in the first (super-)block of every row; rows 0, middle and last are checked whole.
    def matching(
        self, module_name: str, weight: torch.Tensor, n_heads: int, n_kv_heads: int
    ) -> tuple[BlockTensor | BlockRows | None, str]:
        """The file's blocks for ``module_name`` in the row order under which they dequantize to
        ``weight`` (the loaded model's, [out, in]: every row's first block and three whole rows
        compared exactly; un-permuted rows as a :class:`BlockRows`, not moved); else (None, why not)."""
        names = [n for n in gguf_tensor_names(module_name) if n in self.file.tensors]
        if not names:
            return None, "not in the file"
        name = names[0]
        bt = self.blocks(name)
        if bt is None:
            return None, f"{name} is {self.type_name(name)}"
        if (bt.rows, bt.cols) != tuple(weight.shape):
            return None, f"{name} has shape {(bt.rows, bt.cols)}, the model's weight {tuple(weight.shape)}"
        orders = [np.arange(bt.rows)]
        for heads in dict.fromkeys((n_heads, n_kv_heads)):
            if heads and bt.rows % (2 * heads) == 0:
                orders.append(llama_unpermute(bt.rows, heads))
        target = weight.detach().cpu()
        width = min(bt.cols, bt.format.block_weights)
        first = BlockTensor(bt.format, np.ascontiguousarray(bt.blocks[:, : bt.format.block_bytes]), width)
        first_values = first.dequantize()
        probe_rows = sorted({0, bt.rows // 2, bt.rows - 1})
        for order in orders:
            if not torch.equal(first_values[torch.from_numpy(order)].to(target.dtype), target[:, :width]):
                continue
            whole = bt.take_rows(order[probe_rows]).dequantize()
            if torch.equal(whole.to(target.dtype), target[probe_rows]):
                return (bt if order is orders[0] else bt.view_rows(order)), ""
        return None, f"{name} does not dequantize to the model's weight"
