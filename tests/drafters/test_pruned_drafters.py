"""Pruned drafters: a pruned copy of the target as --draft-model DIR, and the target drafting from a
2:4-sparse copy of its own blocks (--draft-quant sparse24, or sparse24-f32). Greedy output is the dense target's,
token for token; sampled output keeps the target's distribution."""

import json

import pytest
import torch
from stats_helpers import binned_chisquare_pvalue, generate_per_seed
from tiny_models import save_tiny_llama, tiny_llama

from fastdecode import Engine, GenerationConfig, SamplingParams
from fastdecode.backends import make_target
from fastdecode.backends.base import PagedSequence
from fastdecode.cli import main
from fastdecode.decoding.sampling import probabilities
from fastdecode.drafters.factory import DrafterOptions

PROMPT_TEXT = " ".join(f"w{i % 7}" for i in range(30))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def pruned_dir(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "m24"
    args = ["compress", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--out", str(out)]
    assert main([*args, "--eval-windows", "0"]) == 0
    return out


def _generate(capsys, model_dir, *args):
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            PROMPT_TEXT,
            "--no-chat",
            "--max-new-tokens",
            "24",
            "--json",
        ]
        + list(args)
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.mark.parametrize(
    "drafter_args",
    [
        ["--draft-model", "{pruned}"],  # the pruned float copy
        ["--draft-model", "{pruned}", "--draft-quant", "sparse24"],  # the pruned copy on the sparse kernel
        ["--draft-model", "{pruned}", "--draft-quant", "sparse24-f32"],  # its float values on the sparse kernel
        ["--draft-quant", "sparse24"],  # the target's own weights, pruned 2:4 by magnitude, as the drafter
    ],
)
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_pruned_drafter_gives_the_dense_targets_output(capsys, model_dir, pruned_dir, drafter_args, backend):
    plain = _generate(capsys, model_dir, "--backend", backend)
    args = [a.format(pruned=pruned_dir) for a in drafter_args]
    spec = _generate(capsys, model_dir, "--backend", backend, "--drafter", "draft-model", "--draft-k", "3", *args)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["acceptance"]["drafted_tokens"] > 0


def _three_tokens_sampled(engine, prompt, params, runs):
    results = generate_per_seed(
        engine, prompt, GenerationConfig(max_new_tokens=3, draft_k=2, sampling=params), range(runs)
    )
    return [r.token_ids for r in results]


def test_sampling_with_the_sparse_self_drafter_keeps_the_target_distribution(tokenizer):
    """Tokens 1 and 2 follow the dense target's marginals (chi-square, alpha = 0.001, fixed
    seeds); the sparse copy's own marginal of token 2 is far from them (the negative control)."""
    target = tiny_llama(0, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    prompt = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71]
    params = SamplingParams(temperature=0.05, top_k=6)
    native, sparse = make_target(target, "native"), make_target(target, "native", "sparse24")

    def dist(executor, rows):
        return torch.stack([probabilities(PagedSequence(executor).forward(row, 1), params)[0] for row in rows])

    p1 = dist(native, [prompt])[0]
    firsts = p1.nonzero()[:, 0].tolist()
    marginal2 = p1[firsts] @ dist(native, [prompt + [a] for a in firsts])
    draft_marginal2 = p1[firsts] @ dist(sparse, [prompt + [a] for a in firsts])
    assert float((marginal2 - draft_marginal2).abs().sum()) > 0.1  # the drafter disagrees with the target

    drafter = DrafterOptions(name="draft-model", k=2, draft_quant="sparse24").build(target, tokenizer)
    outputs = _three_tokens_sampled(Engine(target, tokenizer, drafter=drafter, target=native), prompt, params, 1000)
    assert binned_chisquare_pvalue([o[0] for o in outputs], p1) > 0.001
    assert binned_chisquare_pvalue([o[1] for o in outputs], marginal2) > 0.001
    assert binned_chisquare_pvalue([o[1] for o in outputs], draft_marginal2) < 0.001
