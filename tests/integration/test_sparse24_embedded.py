"""The embedded model on the 2:4 sparse q8_0 kernel (``--weights sparse24``, pruned by magnitude
on load): a projection's output is the dense q8_0 kernel's over the same pruned weights, bit for
bit, and speculation against it is token-identical to plain decoding. (As a drafter,
``--draft-quant sparse24``: tests/drafters/test_pruned_drafters.py on a tiny model.)"""

import pytest
import torch

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.formats.gguf import BlockLinear
from fastdecode.formats.sparse import SparseWeights, prune_2_4
from fastdecode.gguf_blocks import BlockTensor

pytestmark = pytest.mark.integration

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


def test_speculation_against_sparse24_is_lossless(smollm2):
    model, tokenizer = smollm2
    sparse = make_target(model, "native", "sparse24")
    assert sparse.weights == "sparse24+q8_0"
    plain = Engine(model, tokenizer, target=sparse).generate(PROMPT, max_new_tokens=24)
    spec = Engine(model, tokenizer, drafter=build_drafter("ngram", n=3), target=sparse)
    assert spec.generate(PROMPT, max_new_tokens=24, draft_k=4).token_ids == plain.token_ids
