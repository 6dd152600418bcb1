"""A mixture of experts' pass cost (``engine/moe_cost.py``): the experts FFN counts the distinct experts
each pass runs, the engine hands the counts to the cost model, whose expected experts per row count
follow what routing did, and the plan on a MoE cost curve drafts shorter than on a dense one of the
same cost per row; cost-aware decoding on a tiny MoE stays token-identical to plain."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fastdecode import Engine, build_drafter
from fastdecode.backends import PagedSequence, make_target
from fastdecode.backends.base import ExpertsProfile
from fastdecode.decoding.metrics import AcceptanceStats
from fastdecode.engine import BatchDraftPolicy
from fastdecode.engine.moe_cost import ExpertsCostModel

# OLMoE, 2 layers, top-2 of 8 experts (tests/backends/test_moe.py's shapes)
CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=False,
)
PROMPT = [1] + [10, 11, 12, 13, 14, 15, 16, 17] * 3 + [20, 21, 22, 23, 24, 25, 26]  # 32 tokens


@pytest.fixture(scope="module")
def moe_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("olmoe", **CONFIG)).float().eval()


def test_the_experts_ffn_counts_the_experts_each_pass_runs(moe_model):
    target = make_target(moe_model, "native")
    profile = target.experts_profile()
    assert (profile.n_layers, profile.n_experts, profile.top_k) == (2, 8, 2) and 0 < profile.expert_share < 1
    target.take_experts_run()
    seq = PagedSequence(target)
    seq.forward(PROMPT, 1)  # 32 rows: at most every expert of each layer
    prompt_experts = target.take_experts_run()
    assert 2 * 2 < prompt_experts <= 2 * 8
    seq.forward([40], 1)  # one row: its top 2 in each of 2 layers
    assert target.take_experts_run() == 4
    assert target.take_experts_run() == 0  # taken: the counters start again
    ffn = target.layers[0].ffn
    h = torch.randn(70, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(2))
    ffn(target._ops, h[:1])
    assert ffn.experts_run == 2
    ffn(target._ops, h)
    assert ffn.experts_run == 2 + 8


def test_a_dense_target_reports_no_experts(tiny_model, tokenizer):
    target = make_target(tiny_model, "native")
    assert target.experts_profile() is None and target.take_experts_run() is None
    assert Engine(tiny_model, tokenizer, target=target).policy.experts is None  # planned as before, bit for bit


def test_expected_experts_follow_the_counted_ones(moe_model):
    target = make_target(moe_model, "native")
    ffns = [layer.ffn for layer in target.layers]
    model = ExpertsCostModel(target.experts_profile(), BatchDraftPolicy.PRIOR_ROW_COST)
    gen = torch.Generator().manual_seed(3)

    def counted(rows: int) -> float:
        """Mean distinct experts over 2 layers of 20 passes of ``rows`` random rows."""
        total = 0
        for _ in range(20):
            h = torch.randn(rows, CONFIG["hidden_size"], generator=gen)
            for ffn in ffns:
                ffn.experts_run = 0
                ffn(target._ops, h)
                total += ffn.experts_run
        return total / 20

    assert model.expected_experts(1) == counted(1) == 4  # top 2 of each of 2 layers
    for rows in (2, 4, 8):  # uniform routing's union against what this router did
        assert model.expected_experts(rows) == pytest.approx(counted(rows), rel=0.25)
    model.record(4, round(counted(4)))
    measured = counted(6)
    assert model.expected_experts(6) == pytest.approx(measured, rel=0.15)
    assert model.expected_experts(6) <= 2 * 8


def _acceptance(rate: float, k_max: int) -> list[float]:
    stats = AcceptanceStats(draft_k=k_max, prior_rate=rate)
    return stats.conditional_acceptance(k_max)


# OLMoE-1B-7B's shape: 16 layers, top 8 of 64 experts; one expert ~0.5% of a one-row step's bytes (6.3M of 1.3B parameters)
OLMOE = ExpertsProfile(n_layers=16, n_experts=64, top_k=8, expert_share=0.005)


@pytest.mark.parametrize("measured_rows", [(1,), (1, 2), (1, 2, 3)])
def test_a_moe_cost_curve_gets_a_shorter_draft_than_a_dense_one(measured_rows):
    # the same dense part, T = 1 + 0.1 (r - 1); the MoE pays 0.005 a step per expert its rows add
    per_row, per_expert = 0.1, 0.005
    uniform = ExpertsCostModel(OLMOE, BatchDraftPolicy.PRIOR_ROW_COST)
    dense, moe = BatchDraftPolicy(), BatchDraftPolicy()
    moe.experts = ExpertsCostModel(OLMOE, BatchDraftPolicy.PRIOR_ROW_COST)
    dense.forward_s = {r: 1 + per_row * (r - 1) for r in range(1, 10)}
    x1 = uniform.expected_experts(1)
    moe.forward_s = {r: 1 + per_row * (r - 1) + per_expert * (uniform.expected_experts(r) - x1) for r in measured_rows}
    request = [(_acceptance(0.8, 8), 8)]
    k_dense, k_moe = dense.plan(1, request)[0], moe.plan(1, request)[0]
    assert k_moe < k_dense
    assert moe.cost(4) > dense.cost(4)
    # never planned slower than plain decoding: the plan's rate beats one token per T(1)
    e = 1 + sum(0.8 ** (j + 1) for j in range(k_moe))
    assert k_moe == 0 or e / moe.cost(1 + k_moe) > 1 / moe.cost(1)


def test_the_fit_recovers_a_pass_cost_measured_at_three_row_counts():
    model = ExpertsCostModel(OLMOE, BatchDraftPolicy.PRIOR_ROW_COST)
    true = {r: 2 + 0.05 * r + 0.01 * model.expected_experts(r) for r in (1, 2, 4, 8)}
    b, c = model.slopes({r: true[r] for r in (1, 2, 8)})
    assert b == pytest.approx(0.05) and c == pytest.approx(0.01)
    assert model.cost(4, {r: true[r] for r in (1, 2, 8)}) == pytest.approx(true[4])


def test_cost_aware_decoding_on_a_moe_is_plain_and_counts_its_experts(moe_model, tokenizer):
    plain = Engine(moe_model, tokenizer, target=make_target(moe_model, "native")).generate(
        PROMPT, max_new_tokens=32, min_tokens=32
    )
    engine = Engine(moe_model, tokenizer, drafter=build_drafter("ngram"), target=make_target(moe_model, "native"))
    for _ in range(2):
        result = engine.generate(PROMPT, max_new_tokens=32, min_tokens=32, cost_aware_k=True, draft_k=6)
        assert result.token_ids == plain.token_ids
    experts = engine.policy.experts
    assert experts is not None and experts.expected_experts(1) == 4  # every one-row pass: 2 of 8, 2 layers
    assert all(1 <= x <= 16 for x in (experts.expected_experts(r) for r in range(1, 9)))
