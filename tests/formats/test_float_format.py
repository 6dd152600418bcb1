"""``float`` (``fastdecode.formats.float``): the model's own weights, on fastdecode's
row-invariant GEMM where it runs and ``F.linear`` elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from fastdecode.errors import ConfigError
from fastdecode.formats import weight_format
from fastdecode.formats.float import FloatLinear, RowInvariantLinear, float_kernel_unavailable, make_float_linear
from fastdecode.kernels.cpu import rowgemm_unavailable

FLOAT = weight_format("float")


def test_the_entry():
    assert FLOAT.native_linear is make_float_linear and FLOAT.runs_as_weights
    assert FLOAT.quant_config is None and FLOAT.saved is None and not FLOAT.native_only


def test_torch_kernel_is_f_linear_over_the_models_own_tensor():
    w, b, x = torch.randn(12, 20), torch.randn(12), torch.randn(3, 20)
    layer = FLOAT.native_linear(w, b, "torch")
    assert type(layer) is FloatLinear and layer.weight.data_ptr() == w.data_ptr()
    assert torch.equal(layer(x), F.linear(x, w, b))
    assert layer.weight_bytes() == (12 * 20 + 12) * 4


@pytest.mark.skipif(rowgemm_unavailable() is not None, reason=str(rowgemm_unavailable()))
def test_auto_takes_the_row_invariant_kernel_where_it_runs():
    w, x = torch.randn(12, 20), torch.randn(5, 20)
    layer = FLOAT.native_linear(w, None, "auto")
    assert type(layer) is RowInvariantLinear and layer.kernel == "rowgemm"
    assert torch.equal(layer(x)[2:3], layer(x[2:3]))  # a row's bits do not depend on the row count
    assert layer.layer_projection() == (layer.weight, None, None)


def test_a_weight_the_kernel_cannot_take_falls_back_or_is_refused():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert "float32" in float_kernel_unavailable(w)
    assert type(FLOAT.native_linear(w, None, "auto")) is FloatLinear
    with pytest.raises(ConfigError, match="--float-kernel rowgemm cannot run here"):
        FLOAT.native_linear(w, None, "rowgemm")
