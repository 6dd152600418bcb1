"""Checks shared by the block-format kernel tests (not a test module)."""

import pytest
import torch

from fastdecode.kernels import quant

# Every implementation, each skipped where this library or CPU does not run it (tests run each one
# by name; ``auto`` takes the first that runs).
ALL_IMPLS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in quant.supported_impls(), reason=f"no {name} here"))
    for name in quant.IMPLS
    if name != "auto"
]


def block_acts(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    """Activations [rows, cols] for the block kernels: seeded normal * 4, row 3 (when there is one) all zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 4
    if rows > 3:
        x[3] = 0.0
    return x


def assert_rows_bitwise_invariant(bt, x: torch.Tensor) -> torch.Tensor:
    """Every row of ``x`` [m, cols] (m <= 16) through ``bt``'s packed projection gets the bits it gets in
    the whole pass, for every row count and on 1 and 2 threads, and the torch reference gives the
    same bits; returns the whole pass's output."""
    full = assert_projection_rows_invariant(quant.Projection([quant.pack(bt)], None, bt.cols), x)
    assert torch.equal(full, quant.block_linear_reference(x, [bt]))
    return full


def assert_projection_rows_invariant(proj, x: torch.Tensor) -> torch.Tensor:
    """Every row of ``x`` [m, cols] through ``proj`` gets the bits it gets in the whole pass, for every
    row count (the first rows, and the row alone) and on 1 and 2 threads; returns the whole pass's output."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = proj(x)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in range(1, x.shape[0] + 1):
                assert torch.equal(proj(x[:m]), full[:m]), (threads, m)
                assert torch.equal(proj(x[m - 1 : m]), full[m - 1 : m]), (threads, m)
    finally:
        torch.set_num_threads(before)
    return full
