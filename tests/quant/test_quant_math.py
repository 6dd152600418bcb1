import pytest
import torch

from fastdecode.errors import ConfigError
from fastdecode.quant import math as qmath


def test_int8_round_trip_error_within_half_a_step():
    w = torch.randn(48, 96)
    q, scales = qmath.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == (48, 96) and scales.shape == (48,)
    assert q.abs().max() <= qmath.INT8_QMAX
    err = (qmath.dequantize_int8_per_channel(q, scales) - w).abs()
    assert (err <= scales.unsqueeze(1) / 2 * 1.001 + 1e-7).all()
    # Scales are what the bf16 kernel reads, exactly.
    assert torch.equal(scales, scales.bfloat16().float())


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_round_trip_error_within_half_a_step(group_size):
    w = torch.randn(32, 256) * 0.02 + 0.01
    q, scales, zeros = qmath.quantize_int4_groupwise(w, group_size)
    assert q.dtype == torch.uint8 and q.shape == w.shape and q.max() <= 15
    assert scales.shape == zeros.shape == (32, 256 // group_size)
    deq = qmath.dequantize_int4_groupwise(q, scales, zeros, group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    # Half a step from rounding, plus what bf16 rounding of the zero point can add.
    slack = zeros.abs().repeat_interleave(group_size, dim=1) * 2**-8
    assert ((deq - w).abs() <= step / 2 + slack + 1e-7).all()


def test_constant_and_zero_weights_stay_finite():
    w = torch.zeros(16, 64)
    w[1] = 3.0
    for deq in (
        qmath.dequantize_int8_per_channel(*qmath.quantize_int8_per_channel(w)),
        qmath.dequantize_int4_groupwise(*qmath.quantize_int4_groupwise(w, 32), 32),
    ):
        assert torch.isfinite(deq).all()
        torch.testing.assert_close(deq, w, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("group_size", [16, 48, 512])
def test_int4_rejects_unsupported_group_sizes(group_size):
    with pytest.raises(ConfigError, match="group size"):
        qmath.quantize_int4_groupwise(torch.randn(16, 1024), group_size)


def test_int4_rejects_group_size_not_dividing_in_features():
    with pytest.raises(ConfigError, match="does not divide"):
        qmath.quantize_int4_groupwise(torch.randn(16, 96), 64)


def test_hessian_accumulates_over_batches():
    x = torch.randn(3, 10, 32)  # [batch, tokens, in]
    acc = qmath.HessianAccumulator(32)
    for batch in x:
        acc.add(batch)
    flat = x.reshape(-1, 32)
    torch.testing.assert_close(acc.H, 2 * flat.T @ flat / flat.shape[0])
    torch.testing.assert_close(qmath.gptq_hessian(x), acc.H)


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    # H diagonal: no error can be compensated, so GPTQ must pick exactly RTN's values.
    w = torch.randn(32, 128)
    H = torch.diag(torch.rand(128) + 0.5)
    for got, want in zip(
        qmath.gptq_quantize(w, H, bits=4, group_size=32),
        qmath.quantize_int4_groupwise(w, 32),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(
        qmath.gptq_quantize(w, H, bits=8, group_size=None),
        qmath.quantize_int8_per_channel(w),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _correlated_inputs(n_tokens=512, in_features=128, rank=12):
    """Inputs [n, in] that live near a low-rank subspace, as LLM activations do."""
    generator = torch.Generator().manual_seed(0)
    basis = torch.randn(rank, in_features, generator=generator)
    z = torch.randn(n_tokens, rank, generator=generator)
    return z @ basis + 0.05 * torch.randn(n_tokens, in_features, generator=generator)


@pytest.mark.parametrize("bits, group_size, blocksize", [(4, 32, 128), (4, 64, 64), (4, 128, 32), (8, None, 128)])
def test_gptq_reconstructs_layer_outputs_better_than_rtn(bits, group_size, blocksize):
    x = _correlated_inputs()  # [n, in]
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))  # [out, in]
    H = qmath.gptq_hessian(x)
    if bits == 4:
        rtn = qmath.dequantize_int4_groupwise(*qmath.quantize_int4_groupwise(w, group_size), group_size)
        q, scales, zeros = qmath.gptq_quantize(w, H, bits=4, group_size=group_size, blocksize=blocksize)
        assert q.dtype == torch.uint8 and q.max() <= 15
        gptq = qmath.dequantize_int4_groupwise(q, scales, zeros, group_size)
    else:
        rtn = qmath.dequantize_int8_per_channel(*qmath.quantize_int8_per_channel(w))
        gptq = qmath.dequantize_int8_per_channel(*qmath.gptq_quantize(w, H, bits=8, group_size=None))

    def output_error(w_hat):
        return torch.linalg.norm(x @ w.T - x @ w_hat.T).item()

    # Measured ~0.25 on this fixture; RTN ignores the input correlations entirely.
    assert output_error(gptq) < 0.5 * output_error(rtn)


def test_gptq_rejects_bad_settings():
    w, H = torch.randn(16, 64), torch.eye(64)
    with pytest.raises(ConfigError):
        qmath.gptq_quantize(w, H, bits=3)
    with pytest.raises(ConfigError):
        qmath.gptq_quantize(w, H, bits=8, group_size=32)
    with pytest.raises(ConfigError):
        qmath.gptq_quantize(w, torch.eye(32), bits=4, group_size=32)
