"""The native decoder on its integer-kernel weights (--weights q8_0 | q4_0 | q4_1 | gguf | sparse24 | w8a8:
GGUF's block formats, 2:4 sparse q8_0, int8 per channel x int8 per token), on tiny random models."""

import pytest
import torch
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.backends import BLOCK_PRECISIONS, PagedSequence, make_target
from fastdecode.backends.base import BatchEntry
from fastdecode.backends.linear import BlockLinear
from fastdecode.errors import ConfigError
from fastdecode.formats.float import FloatLinear
from fastdecode.formats.w8a8 import W8A8NativeLinear
from fastdecode.kernels.quant import kernel_unavailable

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]
# the native-only formats on integer kernels (bf16 runs on the float GEMM: tests/formats/test_half_format.py)
INTEGER_PRECISIONS = [w for w in BLOCK_PRECISIONS if w != "bf16"]
KERNELS = ["auto", "torch"] if kernel_unavailable() is None else ["torch"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0, num_hidden_layers=3, eos_token_id=2, bos_token_id=1, pad_token_id=0)


@pytest.mark.parametrize("float_kernel", KERNELS)
@pytest.mark.parametrize("weights", INTEGER_PRECISIONS)
def test_a_pass_gives_each_row_a_decode_steps_bits(model, weights, float_kernel):
    executor = make_target(model, "native", weights, float_kernel)
    f32 = weights == "sparse24-f32"  # float32 values: the float GEMM's kernel, its LM head float
    assert executor.float_kernel == (("rowgemm" if f32 else "qdot") if float_kernel == "auto" else "torch")
    head = FloatLinear if f32 else W8A8NativeLinear if weights == "w8a8" else BlockLinear
    assert isinstance(executor.lm_head, head)
    assert (executor._layer_calls is not None) == (float_kernel == "auto")  # one fused call a layer on the C kernels
    target = PagedSequence(executor)
    together = target.forward(PROMPT, len(PROMPT))
    target.reset()
    one_by_one = torch.cat([target.forward([t], 1) for t in PROMPT])
    assert torch.equal(together, one_by_one)
    target.reset()
    chunks = torch.cat([target.forward(PROMPT[:5], 5), target.forward(PROMPT[5:13], 8), target.forward(PROMPT[13:], 3)])
    assert torch.equal(chunks, together)


@pytest.mark.parametrize("weights", INTEGER_PRECISIONS)
def test_ragged_batch_rows_match_single_sequences(model, weights):
    target = make_target(model, "native", weights)
    cache = target.new_kv_cache(16, block_size=4)
    a, b = PROMPT[:7], PROMPT[3:12]
    out = target.forward_batch(cache, [BatchEntry(a, 0, [0, 1], 3), BatchEntry(b, 0, [2, 3, 4], 2)])
    alone_a = target.forward_batch(cache, [BatchEntry(a, 0, [5, 6], 3)])
    alone_b = target.forward_batch(cache, [BatchEntry(b, 0, [7, 8, 9], 2)])
    assert torch.equal(out, torch.cat([alone_a, alone_b]))


# (sparse24 and sparse24-f32 prune half the weights, so they are not close to float:
# tests/formats/test_sparse_format.py holds them to q8_0's / float's bits over the same pruned weights instead)
@pytest.mark.parametrize("weights", [w for w in INTEGER_PRECISIONS if not w.startswith("sparse24")])
def test_numeric_model_is_its_own_and_close_to_float(model, weights):
    ref = PagedSequence(make_target(model, "native", "float")).forward(PROMPT, len(PROMPT))
    low = PagedSequence(make_target(model, "native", weights)).forward(PROMPT, len(PROMPT))
    assert not torch.equal(low, ref)
    tol = {"q8_0": 0.05, "q4_0": 0.3, "q4_1": 0.3, "gguf": 0.05, "w8a8": 0.05}[weights]
    assert (low - ref).abs().max() < tol * ref.abs().max()


def test_weights_name_the_numeric_model(model):
    assert make_target(model, "native", "q4_0").weights == "q4_0"
    target = make_target(model, "native", "gguf")  # a float model has no GGUF file: every layer q8_0
    assert target.weights == "gguf:q8_0"
    assert "not loaded from a GGUF file" in target.kernel_note
    assert target.weight_bytes() < make_target(model, "native", "int8").weight_bytes()
    with pytest.raises(ConfigError, match="native backend"):
        make_target(model, "hf", "q4_1")


@pytest.fixture(scope="module")
def plain(model, tokenizer):
    return {
        w: Engine(model, tokenizer, target=make_target(model, "native", w)).generate(PROMPT, max_new_tokens=40)
        for w in INTEGER_PRECISIONS
    }


@pytest.mark.parametrize("weights", INTEGER_PRECISIONS)
def test_ngram_drafting_is_token_identical_to_plain(model, tokenizer, plain, weights):
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram", n=3), target=make_target(model, "native", weights))
    result = engine.generate(PROMPT, max_new_tokens=40, draft_k=4)
    assert result.token_ids == plain[weights].token_ids
    assert result.acceptance.drafted_tokens > 0


@pytest.mark.parametrize("weights", INTEGER_PRECISIONS)
def test_draft_model_drafting_is_token_identical_to_plain(model, tokenizer, plain, weights):
    drafter = build_drafter("draft-model", model=tiny_llama(7, eos_token_id=2, bos_token_id=1, pad_token_id=0), k=3)
    engine = Engine(model, tokenizer, drafter=drafter, target=make_target(model, "native", weights))
    result = engine.generate(PROMPT, max_new_tokens=40, draft_k=3)
    assert result.token_ids == plain[weights].token_ids
    assert result.acceptance.drafted_tokens > result.acceptance.accepted_tokens  # rollbacks happened


def test_oracle_drafts_are_fully_accepted_at_low_bit(model, tokenizer, plain, oracle_drafter):
    reference = PROMPT + plain["q4_1"].token_ids
    drafter = oracle_drafter(reference, corrupt=lambda step, i: step % 3 == 2 and i == 2)
    engine = Engine(model, tokenizer, drafter=drafter, target=make_target(model, "native", "q4_1"))
    result = engine.generate(PROMPT, max_new_tokens=40, draft_k=6)
    assert result.token_ids == plain["q4_1"].token_ids
    assert result.acceptance.accepted_tokens > 20


def test_batched_requests_get_their_single_request_tokens(model, tokenizer, plain):
    engine = Engine(
        model,
        tokenizer,
        drafter=build_drafter("ngram", n=3),
        target=make_target(model, "native", "q4_0"),
        max_num_seqs=3,
    )
    prompts = [PROMPT, PROMPT[:9], PROMPT[4:]]
    batch = engine.generate(prompts, max_new_tokens=24)
    for prompt, result in zip(prompts, batch):
        alone = Engine(model, tokenizer, target=make_target(model, "native", "q4_0")).generate(
            prompt, max_new_tokens=24
        )
        assert result.token_ids == alone.token_ids
    assert batch[0].token_ids == plain["q4_0"].token_ids[:24]


@pytest.mark.parametrize("weights", ["q4_1", "sparse24", "w8a8"])
def test_probe_times_the_block_gemms_alone(model, weights):
    from fastdecode.bench.probe import block_kernel_cost

    target = make_target(model, "native", weights)
    cost = block_kernel_cost(target, repeats=1)
    layers = [f for layer in target.layers for f in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [target.lm_head]
    assert cost.weights == target.weights and cost.weight_bytes == sum(f.weight_bytes() for f in layers)
    assert cost.gemm_1_ms > 0 and cost.gemm_8_ms > 0
    with pytest.raises(ConfigError):
        block_kernel_cost(make_target(model, "native", "float"))


def test_probe_perplexity_of_a_target_is_the_models(model, tokenizer):
    from fastdecode.bench.probe import target_perplexity
    from fastdecode.quant.quality import perplexity

    text = "the cat sat on the mat; the dog sat on the log. " * 2
    ref = perplexity(model, tokenizer, text)
    assert abs(target_perplexity(make_target(model, "native", "float"), tokenizer, text) - ref) < 1e-4 * ref
    low = target_perplexity(make_target(model, "native", "q4_0"), tokenizer, text)
    assert low != ref and abs(low - ref) < 0.1 * ref
