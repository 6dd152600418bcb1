"""A verification pass gives every row the very bits a one-token decode step gives it."""

import copy

import pytest
import torch
from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode.backends import make_target


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, **dict(KERNEL_FRIENDLY, max_position_embeddings=256))


@pytest.mark.parametrize("dtype,weights", [(torch.float32, "float"), (torch.bfloat16, "float"),
                                           (torch.float32, "int8"), (torch.float32, "int4")])
@pytest.mark.parametrize("n", [2, 3, 5, 8, 13])
def test_verify_rows_equal_decode_steps_bitwise(model, dtype, weights, n):
    target = make_target(copy.deepcopy(model).to(dtype), "native", weights)
    prompt = list(range(3, 40))
    target.forward(prompt, 1)
    drafts = list(range(50, 50 + n))
    verify = target.forward(drafts, n)
    assert target.cache_len == len(prompt) + n
    target.truncate(len(prompt))
    steps = torch.cat([target.forward([t], 1) for t in drafts])
    assert torch.equal(verify, steps)


def test_row_group_is_probed_from_the_model(model):
    rows_min, rows_max = make_target(model, "native").row_group
    assert 1 <= rows_min <= rows_max <= 16
