"""The native decoder against the transformers path it replaces."""

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from fastdecode import Engine, build_drafter
from fastdecode.backends import HFTarget, NativeTarget, PagedSequence, make_target, native_support
from fastdecode.errors import ConfigError
from fastdecode.kernels.cpu import PagedRows

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _qwen2():
    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=False)).eval()


def _llama_bf16():
    torch.manual_seed(2)
    return LlamaForCausalLM(LlamaConfig(**SMALL, rope_theta=100000.0)).to(torch.bfloat16).eval()


def test_logits_match_transformers_through_prefill_decode_and_rollback(tiny_model):
    native, hf = PagedSequence(NativeTarget(tiny_model)), HFTarget(tiny_model)
    prompt = [1, 10, 20, 30, 40, 50]
    torch.testing.assert_close(native.forward(prompt, 3), hf.forward(prompt, 3))
    torch.testing.assert_close(native.forward([7, 8, 9, 10], 4), hf.forward([7, 8, 9, 10], 4))
    native.truncate(7)
    hf.truncate(7)
    assert native.cache_len == hf.cache_len == 7
    torch.testing.assert_close(native.forward([11, 12], 2), hf.forward([11, 12], 2))
    native.reset()
    torch.testing.assert_close(native.forward(prompt, 1), HFTarget(tiny_model).forward(prompt, 1))


@pytest.mark.parametrize("build", [_qwen2, _llama_bf16], ids=["qwen2-with-qkv-bias", "llama-bf16"])
def test_other_llama_family_models(build):
    model = build()
    tol = {"atol": 2e-2, "rtol": 2e-2} if model.dtype == torch.bfloat16 else {}
    native, hf = PagedSequence(NativeTarget(model)), HFTarget(model)
    torch.testing.assert_close(native.forward([1, 4, 9, 16, 25], 5), hf.forward([1, 4, 9, 16, 25], 5), **tol)
    torch.testing.assert_close(native.forward([36], 1), hf.forward([36], 1), **tol)


def test_weights_are_shared_with_the_model_not_copied(tiny_model):
    ref = tiny_model(torch.tensor([[1, 2, 3]])).logits
    NativeTarget(tiny_model)
    attn = tiny_model.model.layers[0].self_attn
    ptr = attn.q_proj.weight.data_ptr()
    NativeTarget(tiny_model)  # a second target finds the projections already fused
    assert attn.q_proj.weight.data_ptr() == ptr
    assert attn.k_proj.weight.data_ptr() == ptr + attn.q_proj.weight.numel() * attn.q_proj.weight.element_size()
    torch.testing.assert_close(tiny_model(torch.tensor([[1, 2, 3]])).logits, ref, rtol=0, atol=0)


@pytest.mark.parametrize("drafter", [None, "ngram", "prompt-lookup"])
def test_greedy_output_identical_across_backends(tiny_model, tokenizer, drafter):
    prompt = [1] + [10, 11, 12, 13, 14] * 6
    hf_plain = Engine(tiny_model, tokenizer, target=HFTarget(tiny_model)).generate(prompt, max_new_tokens=40)
    engine = Engine(
        tiny_model, tokenizer, drafter=build_drafter(drafter) if drafter else None, target=NativeTarget(tiny_model)
    )
    result = engine.generate(prompt, max_new_tokens=40)
    assert result.token_ids == hf_plain.token_ids


def test_unsupported_architecture_falls_back_or_refuses():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=64)).eval()
    assert "gpt2" in native_support(gpt2)
    assert make_target(gpt2, "auto").name == "hf"
    with pytest.raises(ConfigError, match="cannot run this model"):
        make_target(gpt2, "native")


def test_gemma3_variants_it_cannot_run_stay_on_transformers():
    torch.manual_seed(0)
    capped = Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, head_dim=8, final_logit_softcapping=30.0)).eval()
    assert "final_logit_softcapping" in native_support(capped)
    assert make_target(capped, "auto").name == "hf"


def test_sliding_window_models_stay_on_transformers():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    ).eval()
    assert native_support(model) is not None
    assert make_target(model).name == "hf"


def test_auto_picks_native_for_llama(tiny_model):
    assert make_target(tiny_model).name == "native"
    with pytest.raises(ConfigError, match="unknown backend"):
        make_target(tiny_model, "tensorrt")
    with pytest.raises(ConfigError, match="unknown weight precision"):
        make_target(tiny_model, "native", "int3")


def test_float_kernel_selection(tiny_model):
    from fastdecode.kernels.cpu import rowgemm_unavailable

    torch_target = make_target(tiny_model, "native", "float", "torch")
    assert torch_target.float_kernel == "torch" and not torch_target.cpu_kernels
    auto = make_target(tiny_model, "native", "float", "auto")
    assert auto.float_kernel == ("rowgemm" if rowgemm_unavailable() is None else "torch")
    assert make_target(tiny_model, "hf").float_kernel is None
    assert make_target(tiny_model, "native", "int8").float_kernel == auto.float_kernel  # int8 has both kernels too
    assert make_target(tiny_model, "native", "int8", "torch").float_kernel == "torch"
    assert make_target(tiny_model, "native", "int4").float_kernel is None  # torch's packed int4 only
    with pytest.raises(ConfigError, match="unknown float kernel"):
        make_target(tiny_model, "native", "float", "mkl")
    with pytest.raises(ConfigError, match="unknown float kernel"):  # checked where the layers are made, for int8 too
        NativeTarget(tiny_model, weights="int8", float_kernel="mkl")
    with pytest.raises(ConfigError, match="cannot run here"):
        make_target(_llama_bf16(), "native", "float", "rowgemm")


@pytest.mark.parametrize("float_kernel", ["auto", "torch"])
def test_both_float_kernels_match_transformers(tiny_model, float_kernel):
    native, hf = PagedSequence(make_target(tiny_model, "native", "float", float_kernel)), HFTarget(tiny_model)
    prompt = [1, 10, 20, 30, 40, 50, 60, 70]
    torch.testing.assert_close(native.forward(prompt, 8), hf.forward(prompt, 8))
    torch.testing.assert_close(native.forward([5, 6, 7], 3), hf.forward([5, 6, 7], 3))  # a verification pass
    torch.testing.assert_close(native.forward([8], 1), hf.forward([8], 1))


@pytest.mark.parametrize(
    "build",
    [lambda: _kernel_sized(LlamaForCausalLM, LlamaConfig), lambda: _kernel_sized(Qwen2ForCausalLM, Qwen2Config)],
    ids=["llama", "qwen2-with-qkv-bias"],
)
def test_one_call_layers_give_the_per_kernel_bits(build):
    from fastdecode.kernels.cpu import rowgemm_unavailable

    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    model = build()
    fused, per_call = PagedSequence(NativeTarget(model)), PagedSequence(NativeTarget(model))
    assert fused.executor._layer_calls is not None
    per_call.executor._layer_calls = None  # the same kernels, called one by one from Python
    prompt = list(range(3, 30))
    for target in (fused, per_call):
        target.forward(prompt, 1)
    for tokens in ([40], [41, 42, 43, 44, 45], [46]):  # a decode step, a verification pass, a step
        assert torch.equal(fused.forward(tokens, len(tokens)), per_call.forward(tokens, len(tokens)))
    assert fused.cache_len == per_call.cache_len
    for cache_a, cache_b in zip(fused._cache.k + fused._cache.v, per_call._cache.k + per_call._cache.v):
        assert torch.equal(written_kv(fused, cache_a), written_kv(per_call, cache_b))


def _kernel_sized(model_cls, config_cls):
    torch.manual_seed(3)
    extra = {"use_sliding_window": False} if config_cls is Qwen2Config else {}
    return model_cls(config_cls(**dict(SMALL, hidden_size=64, intermediate_size=96), **extra)).eval()


def test_int8_layers_run_as_one_call_with_the_per_kernel_bits():
    from fastdecode.kernels.cpu import rowgemm_unavailable

    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    model = _kernel_sized(Qwen2ForCausalLM, Qwen2Config)
    fused, per_call = (
        PagedSequence(NativeTarget(model, weights="int8")),
        PagedSequence(NativeTarget(model, weights="int8")),
    )
    assert fused.executor._layer_calls is not None and fused.executor.float_kernel == "rowgemm"
    per_call.executor._layer_calls = None
    for target in (fused, per_call):
        target.forward(list(range(3, 30)), 1)
    for tokens in ([40], [41, 42, 43, 44, 45]):
        assert torch.equal(fused.forward(tokens, len(tokens)), per_call.forward(tokens, len(tokens)))


def test_layer_stack_checks_pools_it_has_not_seen_and_follows_a_grown_cache():
    from fastdecode.kernels.cpu import rowgemm_unavailable

    if rowgemm_unavailable() is not None:
        pytest.skip(rowgemm_unavailable())
    torch.manual_seed(3)
    model = LlamaForCausalLM(
        LlamaConfig(**dict(SMALL, hidden_size=64, intermediate_size=96, max_position_embeddings=1024))
    ).eval()
    fused, per_call = PagedSequence(NativeTarget(model)), PagedSequence(NativeTarget(model))
    per_call.executor._layer_calls = None
    first = fused.forward(list(range(3, 13)), 1)
    assert torch.equal(first, per_call.forward(list(range(3, 13)), 1))
    pools = fused._cache.k
    long = [3 + i % 90 for i in range(5 * fused.BLOCK)]  # past the first cache: new pools, pointers looked up again
    assert torch.equal(fused.forward(long, 3), per_call.forward(long, 3))
    assert fused._cache.k[0] is not pools[0]
    assert torch.equal(fused.forward([7], 1), per_call.forward([7], 1))
    (_, _, stack), cache = fused.executor._layer_calls[0], fused._cache  # one run: every layer on the C path
    bad = [k[:, :, :, :-8].contiguous() for k in cache.k]  # pools of another head size, never seen
    x = torch.zeros(1, stack.hidden)
    rope = [(torch.zeros(1, fused.executor.head_dim), torch.zeros(1, fused.executor.head_dim))] * len(bad)
    rows = PagedRows(torch.tensor([0]), torch.tensor([0]), torch.tensor([[0]]), cache.pool.block_size)
    with pytest.raises(ValueError, match="caches do not fit"):
        stack(x, rope, bad, bad, rows, fused.executor.scale)


def written_kv(sequence, pool):
    """The K or V rows of the positions a sequence's private cache has written,
    [cache_len, KV, D] (the pool [num_blocks, KV, block_size, D] is allocated uninitialized)."""
    B = pool.shape[2]
    t = torch.arange(sequence.cache_len)
    return pool[torch.tensor(sequence._table)[t // B], :, t % B]


def test_sequences_share_rope_tables_that_only_grow():
    """Sequences on one executor (a drafter's, one per request) share the rotary tables: one at
    a short context must not shrink what one at a long context indexes."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "max_position_embeddings": 1024})).eval()
    executor = NativeTarget(model)
    long, short, fresh = PagedSequence(executor), PagedSequence(executor), PagedSequence(NativeTarget(model))
    ids = [(7 * i) % 96 for i in range(300)]
    long.forward(ids, 1)
    short.forward(ids[:10], 1)
    long.truncate(279)
    out = long.forward([5], 1)  # position 279: within the table as long built it
    fresh.forward(ids[:279], 1)
    assert torch.equal(out, fresh.forward([5], 1))
