"""The native decoder's linear layers: which kernel runs at which row count."""

import pytest
import torch
import torch.nn.functional as F

from fastdecode.backends.linear import RowInvariantInt8Linear
from fastdecode.kernels.cpu import rowgemm_i8, rowgemm_unavailable
from fastdecode.quant.math import dequantize_int8_per_channel

pytestmark = pytest.mark.skipif(rowgemm_unavailable() is not None, reason=str(rowgemm_unavailable()))


def test_int8_prefill_runs_the_dequantized_weight_and_steps_the_row_invariant_kernel():
    gen = torch.Generator().manual_seed(0)
    big = RowInvariantInt8Linear(torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen))
    small = RowInvariantInt8Linear(torch.randn(8, 24, generator=gen), None)
    x_big, x_small = torch.randn(40, 40, generator=gen), torch.randn(30, 24, generator=gen)
    dequantized = dequantize_int8_per_channel(big.qweight, big.scales).float()
    # Decode and verification passes (<= MAX_ROWS rows): the row-invariant kernel, bit for bit.
    rows = RowInvariantInt8Linear.MAX_ROWS
    assert torch.equal(big(x_big[:rows]), rowgemm_i8(x_big[:rows], big.qweight, big.scales, big.bias))
    # A prefill: MKL over q * scale, in the buffer the layers share.
    prefill = big(x_big)
    assert torch.equal(prefill, F.linear(x_big, dequantized, big.bias))
    small(x_small)  # reuses the shared buffer for another layer ...
    assert torch.equal(big(x_big), prefill)  # ... and the first layer's prefill is unchanged
    torch.testing.assert_close(prefill[:rows], big(x_big[:rows]), rtol=1e-5, atol=1e-5)  # same numeric model
