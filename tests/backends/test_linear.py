"""The native decoder's linear layers: which kernel runs at which row count."""

import pytest
import torch
import torch.nn.functional as F

from fastdecode.backends.linear import RowInvariantInt8Linear
from fastdecode.kernels.cpu import rowgemm_i8, rowgemm_unavailable
from fastdecode.quant.math import dequantize_int8_per_channel

pytestmark = pytest.mark.skipif(rowgemm_unavailable() is not None, reason=str(rowgemm_unavailable()))


@pytest.mark.parametrize("layer_type", ["float32", "int8"])
def test_every_row_count_runs_the_row_invariant_kernel(layer_type):
    """Prefill chunks too: a row's bits never depend on how many rows share the call."""
    from fastdecode.backends.linear import RowInvariantLinear

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    layer = RowInvariantInt8Linear(w, b) if layer_type == "int8" else RowInvariantLinear(w, b)
    x = torch.randn(70, 40, generator=gen)
    full = layer(x)
    for m in (1, 3, 16, 17, 33):
        assert torch.equal(layer(x[:m]), full[:m]), m
        assert torch.equal(layer(x[m : m + 5]), full[m : m + 5]), m
    if layer_type == "int8":
        assert torch.equal(full, rowgemm_i8(x, layer.qweight, layer.scales, layer.bias))
        reference = F.linear(x, dequantize_int8_per_channel(layer.qweight, layer.scales).float(), b)
        torch.testing.assert_close(full, reference, rtol=1e-5, atol=1e-5)  # the same numeric model
