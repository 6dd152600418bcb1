"""The q4_0 cache's calibrated key affine (backends/kv_calibration.py): found deterministically, for
rotated keys only; the C layers, torch's layers and a KV policy's moves all read the rows it wrote as
the same keys; verification keeps a decode step's bits, and speculation stays lossless (a drafter in
the target's cache, sinks and H2O moves included)."""

import pytest
import torch
from paged_helpers import assert_verify_equals_decode, moved_and_direct
from tiny_models import KERNEL_FRIENDLY, tiny_llama, word_tokenizer

from fastdecode import Engine, build_drafter
from fastdecode.backends import NativeTarget, PagedSequence, make_target
from fastdecode.backends.base import BatchEntry
from fastdecode.kernels.kv_formats import FORMATS
from fastdecode.kv.calibration import CALIBRATION_TOKENS, calibrate_key_affine, calibration_ids

CALIBRATION = [1] + [int(t) for t in torch.randint(3, 60, (200,), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(scope="module")
def model():
    # head_dim 32 (two heads over one KV head), 96 positions: the calibration is cut to the context
    return tiny_llama(3, **dict(KERNEL_FRIENDLY, num_attention_heads=2, num_key_value_heads=1))


def _target(model, kv="q4_0", weights="float", float_kernel="auto", calibration=CALIBRATION, alpha=None):
    """A target over ``kv``, its key affine calibrated on ``calibration``; with ``alpha``, SmoothAttention's
    s at that strength (0: s = 1, mu alone) instead of kv_calibration.ALPHA."""
    target = NativeTarget(
        model, weights=weights, float_kernel=float_kernel, kv_cache_dtype=kv, kv_calibration=calibration
    )
    if alpha is not None:
        target._key_affine = calibrate_key_affine(target, calibration, alpha=alpha)
    return target


@pytest.mark.parametrize("alpha", [None, 0.0])
def test_the_affine_is_deterministic_finite_and_shaped_per_layer(model, alpha):
    target = _target(model, alpha=alpha)
    affine = target.key_affine()
    again = _target(model, alpha=alpha).key_affine()
    layers, kv, d = len(target.layers), target.n_kv_heads, target.head_dim
    assert len(affine) == layers and all(a.shape == (kv, 3 + d, d) and a.dtype == torch.float32 for a in affine)
    assert all(torch.equal(a, b) for a, b in zip(affine, again))  # the same weights: the same bytes
    for a in affine:
        mu, inv_s, s = a[:, :3].unbind(1)
        f = a[:, 3:]  # [KV, D, D]: the rounding's error feedback, strictly upper triangular
        assert torch.equal(f, f.triu(1)) and f.abs().sum() > 0
        assert torch.isfinite(a).all() and (s > 0).all() and torch.equal(inv_s, 1 / s)
        torch.testing.assert_close(s.pow(2).mean(-1), torch.ones(kv))  # mean square 1 per KV head
        assert torch.equal(s[:, : d // 2], s[:, d // 2 :])  # one scale for a RoPE pair's two channels
        assert torch.equal(s, torch.ones_like(s)) == (alpha == 0.0)  # alpha 0: mu alone
        assert mu.abs().sum() > 0
    cache = target.new_kv_cache(2)
    assert cache.k_affine is affine  # the cache carries what its rows mean


def test_mu_is_the_mean_key_over_the_whole_context_not_the_calibrations_positions():
    """Keys R(p) m (one key before RoPE, m, at positions 0 .. 63): mu is the mean of R(p) m over the
    context's 1,000 positions, though the calibration saw 64."""
    import numpy as np

    from fastdecode.kv.calibration import key_affine, rope_tables

    d, n, context = 32, 64, 1000
    theta = 10000.0 ** (-np.arange(0, d, 2) / d)
    angles = np.arange(context)[:, None] * np.concatenate([theta, theta])[None]  # [context, D]
    cos, sin = np.cos(angles), np.sin(angles)
    m = np.random.default_rng(0).normal(size=(2, d))  # [KV, D]

    def rope(x, p):  # x [..., D] at positions p
        return x * cos[p] + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1) * sin[p]

    keys = np.stack([rope(m, p) for p in range(n)])  # [n, KV, D]
    q = np.ones((n, 2, 1, d))
    mu = key_affine(q, keys, rope_tables(cos, sin, n))[:, 0].double().numpy()
    want = np.stack([rope(m, p) for p in range(context)]).mean(0)
    np.testing.assert_allclose(mu, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, keys.mean(0), atol=1e-2)  # the calibration's own mean is another vector


def test_the_query_moment_is_the_moment_over_the_whole_context():
    """Queries R(p) a at the calibration's 48 positions (a: 3 query rows per KV head before RoPE): the
    moment the error feedback is fitted to is E over a and over every position of the context of
    R(p) a a^T R(p)^T, not the calibration's own."""
    import numpy as np

    from fastdecode.kv.calibration import query_moment, rope_tables

    d, n, context, kv, g = 16, 48, 300, 2, 3
    theta = 10000.0 ** (-np.arange(0, d, 2) / d)
    angles = np.arange(context)[:, None] * np.concatenate([theta, theta])[None]
    cos, sin = np.cos(angles), np.sin(angles)
    a = np.random.default_rng(1).normal(size=(n, kv, g, d)) + np.linspace(-2, 2, d)  # not centered

    def rope(x, p):
        return x * cos[p] + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1) * sin[p]

    q = np.stack([rope(a[t], t) for t in range(n)])  # [n, KV, G, D] after RoPE at positions 0 .. n - 1
    got = query_moment(q, rope_tables(cos, sin, n))
    every = np.stack([rope(a, p) for p in range(context)])  # [context, n, KV, G, D]
    x = every.transpose(2, 0, 1, 3, 4).reshape(kv, -1, d)
    np.testing.assert_allclose(got, x.transpose(0, 2, 1) @ x / x.shape[1], rtol=1e-9, atol=1e-9)
    own = query_moment(q)  # without the tables: the calibration positions' moment
    assert not np.allclose(own, got, atol=1e-2)


def test_only_rotated_keys_are_calibrated(model):
    for kv in ("float32", "q8_0", "q8_0/q4_0", "float16/q4_0"):
        target = _target(model, kv)
        assert target.key_affine() is None and target.new_kv_cache(2).k_affine is None, kv
    assert _target(model, calibration=None).key_affine() is None  # no tokens: keys stored as they are


def test_make_target_calibrates_with_the_tokenizer(model):
    tokenizer = word_tokenizer(size=60)
    ids = calibration_ids(tokenizer)
    assert 0 < len(ids) <= CALIBRATION_TOKENS
    assert make_target(model, "native", kv_cache_dtype="q4_0", tokenizer=tokenizer).key_affine() is not None
    assert make_target(model, "native", kv_cache_dtype="q8_0", tokenizer=tokenizer).key_affine() is None
    assert make_target(model, "native", kv_cache_dtype="q4_0").key_affine() is None


@pytest.mark.parametrize(
    "weights,float_kernel", [("float", "auto"), ("q4_0", "auto"), ("int4", "auto"), ("float", "torch")]
)
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("alpha", [None, 0.0])
def test_verify_rows_equal_decode_steps_bitwise_with_the_affine(model, weights, float_kernel, n, alpha):
    executor = _target(model, weights=weights, float_kernel=float_kernel, alpha=alpha)
    assert executor.key_affine() is not None
    assert_verify_equals_decode(executor, n)


@pytest.mark.parametrize("alpha", [None, 0.0])
def test_the_affine_changes_the_rounding_not_the_model(model, alpha):
    """Against float32's logits, calibrated q4_0 keys are a rounding like plain q4_0's; the torch
    layers and the C layers read the same rows as the same keys."""
    prompt = list(range(3, 60))
    f32 = PagedSequence(make_target(model, "native")).forward(prompt, 4)
    plain = PagedSequence(_target(model, calibration=None)).forward(prompt, 4)
    kernels = _target(model, alpha=alpha)
    calibrated = PagedSequence(kernels).forward(prompt, 4)
    assert not torch.equal(calibrated, plain)
    torch.testing.assert_close(calibrated, f32, rtol=0, atol=3e-1)
    torch_path = _target(model, float_kernel="torch")
    cache = torch_path.new_kv_cache(8)
    cache.k_affine = kernels.key_affine()  # the same affine (torch's own calibration rounds otherwise)
    logits = torch_path.forward_batch(cache, [BatchEntry(prompt, 0, list(range(8)), 4)])
    torch.testing.assert_close(logits, calibrated, rtol=0, atol=2e-2)  # the C path rounds its queries to int8


def test_a_moved_key_is_the_key_written_at_its_new_slot_requantized(model):
    target = _target(model)
    moved, direct, table = moved_and_direct(target)
    fmt, affine = FORMATS["q4_0"], target.key_affine()[0]

    def keys(cache, blocks):  # layer 0's keys, [7, D]: the affine undone
        return fmt.load(cache.k[0][blocks].transpose(1, 2), affine).reshape(-1, 32)[:7]

    got, want = keys(moved, table.blocks), keys(direct, [0, 1])
    unmoved = fmt.load(moved.k[0][table.blocks].transpose(1, 2)).reshape(-1, 32)[:7]  # read without the affine
    err, wrong = (got - want).abs().max(), (unmoved - want).abs().max()
    assert err < 0.5 * want.abs().max() and err < wrong  # two roundings of the key, not another key


@pytest.fixture(scope="module")
def policy_model():
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    return tiny_llama(4, **shape, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("policy,alpha", [("sinks", None), ("h2o:0.5", None), ("sinks:4,24", 0.0), ("h2o:0.5", 0.0)])
def test_a_policy_over_a_calibrated_cache_speculates_losslessly(policy_model, tokenizer, oracle_drafter, policy, alpha):
    prompt = [1] + [20, 21, 22, 23] * 5
    target = _target(policy_model, alpha=alpha)
    reference = Engine(policy_model, tokenizer, target=target).generate(prompt, max_new_tokens=110, kv_policy=policy)
    assert reference.finish_reason == "length" and len(prompt) + len(reference.token_ids) > 64
    drafter = oracle_drafter(prompt + reference.token_ids, corrupt=lambda step, i: (step + i) % 5 == 4)
    out = Engine(policy_model, tokenizer, target=target, drafter=drafter).generate(
        prompt, max_new_tokens=110, kv_policy=policy, draft_k=6
    )
    assert out.token_ids == reference.token_ids and out.acceptance.accepted_tokens > 0


def test_another_executor_in_the_targets_cache_reads_it_with_the_caches_affine(policy_model, tokenizer):
    """An executor over the same model without an affine of its own (a drafter drafting in the target's
    blocks) takes the cache's: its step over the target's rows is the target's, bit for bit."""
    prompt = [1] + [20, 21, 22, 23] * 5
    target, other = _target(policy_model), NativeTarget(policy_model)  # other: float32 caches of its own
    assert other.key_affine() is None
    cache = target.new_kv_cache(4)
    assert other.reads_cache(cache)
    target.forward_batch(cache, [BatchEntry(prompt, 0, [0, 1], 0)])
    step = [BatchEntry([30], len(prompt), [0, 1], 1)]
    assert torch.equal(other.forward_batch(cache, step), target.forward_batch(cache, step))
    drafter = build_drafter("draft-model", model=policy_model, weights="int8", k=3)
    plain = Engine(policy_model, tokenizer, target=target).generate(prompt, max_new_tokens=30)
    out = Engine(policy_model, tokenizer, target=target, drafter=drafter).generate(prompt, max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.acceptance.accepted_tokens > 0


def test_a_head_no_query_reaches_gets_plain_rounding():
    import numpy as np

    from fastdecode.kv.calibration import error_feedback

    moment = np.zeros((2, 32, 32))
    a = np.random.default_rng(0).normal(size=(32, 4))
    moment[1] = a @ a.T + 0.1 * np.eye(32)  # a head with queries near 4 directions
    f = error_feedback(moment, np.ones((2, 32)))
    assert np.all(f[0] == 0) and np.abs(f[1]).sum() > 0 and np.all(np.tril(f[1]) == 0)
