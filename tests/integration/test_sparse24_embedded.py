"""The embedded model on the 2:4 sparse q8_0 and float32 kernels (``--weights sparse24`` and
``sparse24-f32``, pruned by magnitude on load): a projection's output is the dense q8_0 / float32
kernel's over the same pruned weights, bit for bit, and speculation against it is token-identical
to plain decoding. (As a drafter,
``--draft-quant sparse24``: tests/drafters/test_pruned_drafters.py on a tiny model.)"""

import pytest
import torch

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.formats.float import RowInvariantLinear
from fastdecode.formats.gguf import BlockLinear
from fastdecode.formats.sparse import SparseWeights, prune_2_4
from fastdecode.kernels.gguf_blocks import BlockTensor

PROMPT = "Write a short poem about the sea."


def test_a_projection_is_the_dense_q8_0_kernel_over_the_same_pruned_weights(smollm2):
    model, _ = smollm2
    attn = model.model.layers[3].self_attn
    modules = (attn.q_proj, attn.k_proj, attn.v_proj)
    sparse = SparseWeights(model)(modules, None)
    dense = BlockLinear([BlockTensor.quantize(prune_2_4(m.weight), "q8_0") for m in modules], None)
    x = torch.randn(9, attn.q_proj.in_features)
    assert torch.equal(sparse(x), dense(x))
    assert torch.equal(sparse(x[:1]), sparse(x)[:1])  # row-invariant


@pytest.mark.parametrize(("weights", "label"), [("sparse24", "sparse24+q8_0"), ("sparse24-f32", "sparse24-f32+float")])
def test_speculation_against_a_sparse_target_is_lossless(smollm2, weights, label):
    model, tokenizer = smollm2
    sparse = make_target(model, "native", weights)
    assert sparse.weights == label
    plain = Engine(model, tokenizer, target=sparse).generate(PROMPT, max_new_tokens=24)
    spec = Engine(model, tokenizer, drafter=build_drafter("ngram", n=3), target=sparse)
    assert spec.generate(PROMPT, max_new_tokens=24, draft_k=4).token_ids == plain.token_ids


def test_an_f32_projection_is_the_dense_float32_kernel_over_the_same_pruned_weights(smollm2):
    model, _ = smollm2
    mlp = model.model.layers[3].mlp
    sparse = SparseWeights(model, values="f32")([mlp.gate_proj, mlp.up_proj], None)
    dense = RowInvariantLinear(torch.cat([prune_2_4(mlp.gate_proj.weight), prune_2_4(mlp.up_proj.weight)]), None)
    x = torch.randn(70, mlp.gate_proj.in_features)
    for m in (1, 3, 8, 17, 48, 70):
        assert torch.equal(sparse(x[:m]), dense(x[:m])), m
