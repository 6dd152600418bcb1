"""Where each row of a pass reads and writes the paged KV cache: :class:`PagedRows`,
the positions, sequences and block tables the C kernels (``cpu.c``) take."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedRows:
    """Where each row of a pass reads and writes the paged KV cache (cpu.c, at
    ``fd_attention_f32``): row i is at position ``pos[i]`` of sequence ``seq[i]``,
    whose blocks are ``tables[seq[i]]`` (position t in block ``tables[s, t // block_size]``).
    A sequence's rows are consecutive, at increasing positions.

    ``mirrors`` (token-tree verification, cpu.c's ``fd_kv_mirror``): int64 [m, 3] rows
    (row i, sequence s, position p), row i's new key and value copied to position p of
    sequence s before the attention; p must be pos[i] (a key carries its position's rotation).

    pos, seq: int64 [n]; tables: int64 [num_seqs, max_blocks] (unused entries any valid block)."""

    pos: torch.Tensor
    seq: torch.Tensor
    tables: torch.Tensor
    block_size: int
    mirrors: torch.Tensor | None = None

    @classmethod
    def contiguous(cls, start: int, n: int, capacity: int) -> PagedRows:
        """n rows at positions start .. start + n - 1 of one cache [KV, capacity, D]: one block."""
        return cls(
            torch.arange(start, start + n, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int64),
            capacity,
        )

    @property
    def n(self) -> int:
        return self.pos.shape[0]

    def scores_floats(self, n_heads: int) -> int:
        """Scratch the attention needs for its scores: n * H * (max_i pos[i] + 1)."""
        return self.n * n_heads * (int(self.pos.max()) + 1) if self.n else 0

    def check(self, pool: torch.Tensor) -> None:
        """pool: one layer's K or V pool, [num_blocks, KV, block_size, D]."""
        if any(
            t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu"
            for t in (self.pos, self.seq, self.tables)
        ):
            raise TypeError("PagedRows: pos, seq and tables must be contiguous int64 CPU tensors")
        if self.pos.dim() != 1 or self.seq.shape != self.pos.shape or self.tables.dim() != 2:
            raise ValueError("PagedRows: pos and seq are [n], tables [num_seqs, max_blocks]")
        if pool.dim() != 4 or pool.shape[2] != self.block_size:
            raise ValueError(
                f"PagedRows: a pool [num_blocks, KV, {self.block_size}, D] is needed, got {tuple(pool.shape)}"
            )
        if self.n == 0:
            return
        if int(self.pos.min()) < 0 or int(self.seq.min()) < 0 or int(self.seq.max()) >= self.tables.shape[0]:
            raise ValueError("PagedRows: a position is negative or a sequence has no block table")
        if int(self.pos.max()) >= self.tables.shape[1] * self.block_size:
            raise ValueError("PagedRows: a position lies past its block table")
        if self.tables.numel() and (int(self.tables.min()) < 0 or int(self.tables.max()) >= pool.shape[0]):
            raise ValueError(f"PagedRows: a block id lies outside the pool of {pool.shape[0]} blocks")
        m = self.mirrors
        if m is not None and m.numel():
            if (
                m.dtype != torch.int64
                or not m.is_contiguous()
                or m.device.type != "cpu"
                or m.dim() != 2
                or m.shape[1] != 3
            ):
                raise TypeError("PagedRows: mirrors must be a contiguous int64 CPU tensor [m, 3]")
            row, s, p = m.unbind(1)
            if (
                int(row.min()) < 0
                or int(row.max()) >= self.n
                or int(s.min()) < 0
                or int(s.max()) >= self.tables.shape[0]
            ):
                raise ValueError("PagedRows: a mirror names a row or a sequence the pass does not have")
            if not torch.equal(p, self.pos[row]):
                raise ValueError("PagedRows: a mirror must copy a row's key to the same position of another sequence")

    def args(self) -> tuple:
        return (self.block_size, self.pos.data_ptr(), self.seq.data_ptr(), self.tables.data_ptr(), self.tables.shape[1])

    def mirror_args(self) -> tuple:
        m = self.mirrors
        return (m.data_ptr(), m.shape[0]) if m is not None and m.numel() else (None, 0)
