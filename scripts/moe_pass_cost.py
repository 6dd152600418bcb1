"""Verification pass cost against the draft length k, dense against mixture of experts (issue 43).

For each model: a context of ``--context`` tokens of the evaluation text is prefilled, then a pass of
k + 1 rows (k = 0..``--max-k``) is timed ``--reps`` times (median, after one warm-up) and rolled back.
Prints per k: the rows, the distinct experts the pass ran (summed over the MoE layers; the executor's
counters) and what the cost model expects (``ExpertsCostModel.expected_experts``, from the one-row
passes' counts and uniform routing), the measured pass time and its ratio to T(1), and the cost the
model predicts from T(1) and T(2) alone (what a request plans with before wider passes are measured).
Then the k the batch draft policy chooses at a few acceptance rates, from the measured table and
from T(1), T(2) alone. A benchmark: it prints figures and asserts nothing.

    PYTHONPATH=src python scripts/moe_pass_cost.py \\
        --models /work/gguf/llama-3.2-1b-q4_k_m-seed0.gguf,/work/gguf/olmoe-1b-7b-q4_k_m-seed0.gguf --weights gguf
    PYTHONPATH=src python scripts/moe_pass_cost.py --tiny   # a smoke run on tiny random models
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastdecode.backends.base import PagedSequence
from fastdecode.decoding.metrics import AcceptanceStats
from fastdecode.engine import BatchDraftPolicy
from fastdecode.engine.moe_cost import ExpertsCostModel

RATES = (0.5, 0.7, 0.8, 0.9)


def tiny_models() -> list[tuple[str, object, list[int]]]:
    """A tiny Llama and a tiny OLMoE (top 2 of 8 experts), random weights, and random token ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    base.update(head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    out = []
    for name, extra in (
        ("llama", dict(intermediate_size=128)),
        ("olmoe", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    ):
        torch.manual_seed(0)
        config = AutoConfig.for_model(name, **base, **extra)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        ids = torch.randint(3, 96, (600,), generator=torch.Generator().manual_seed(0)).tolist()
        out.append((f"tiny-{name}", model, ids))
    return out


def spec_model(spec: str, weights: str):
    """(target, token ids of the evaluation text) for a model spec."""
    from fastdecode.args import EngineArgs
    from fastdecode.data.corpora import evaluation_text
    from fastdecode.evaluation.quality import tokenize

    args = EngineArgs(model=spec, weights=weights)
    model, tokenizer = args.load_model()
    return args.create_target(model, tokenizer), tokenize(tokenizer, evaluation_text()[:20000])


def measure(target, ids: list[int], context: int, max_k: int, reps: int) -> dict[int, tuple[float, float | None]]:
    """rows -> (median pass seconds, mean distinct experts run or None) for rows 1..max_k + 1."""
    seq = PagedSequence(target)
    seq.forward(ids[:context], 1)
    out = {}
    for rows in range(1, max_k + 2):
        times, experts = [], []
        for rep in range(reps + 1):  # the first a warm-up
            target.take_experts_run()
            t = time.perf_counter()
            seq.forward(ids[context : context + rows], rows)
            seconds = time.perf_counter() - t
            run = target.take_experts_run()
            seq.truncate(context)
            if rep:
                times.append(seconds)
                experts.append(run)
        mean = None if experts[0] is None else sum(experts) / len(experts)
        out[rows] = (statistics.median(times), mean)
    return out


def chosen_k(table: dict[int, float], model: ExpertsCostModel | None, rate: float, max_k: int) -> int:
    policy = BatchDraftPolicy()
    policy.experts = model
    policy.forward_s = table
    stats = AcceptanceStats(draft_k=max_k, prior_rate=rate)
    return policy.plan(1, [(stats.conditional_acceptance(max_k), max_k)])[0]


def report(name: str, target, measured: dict[int, tuple[float, float | None]], max_k: int) -> None:
    profile = target.experts_profile()
    model = None
    if profile is not None:
        model = ExpertsCostModel(profile, BatchDraftPolicy.PRIOR_ROW_COST)
        model.record(1, round(measured[1][1]))  # what a request's first one-row passes count
    full = {rows: t for rows, (t, _) in measured.items()}
    early = {rows: full[rows] for rows in (1, 2)}
    predict = BatchDraftPolicy()
    predict.experts, predict.forward_s = model, early
    kind = "dense" if profile is None else f"MoE: {profile.n_layers} layers, top {profile.top_k} of {profile.n_experts}"
    print(f"\n{name} ({kind})")
    print(f"{'k':>3} {'rows':>4} {'experts':>8} {'expected':>8} {'T ms':>9} {'T/T(1)':>7} {'pred T/T(1)':>11}")
    for rows, (seconds, experts) in measured.items():
        run = "-" if experts is None else f"{experts:.1f}"
        expected = "-" if model is None else f"{model.expected_experts(rows):.1f}"
        ratio, pred = seconds / full[1], predict.cost(rows) / full[1]
        print(f"{rows - 1:>3} {rows:>4} {run:>8} {expected:>8} {seconds * 1e3:>9.2f} {ratio:>7.2f} {pred:>11.2f}")
    for rate in RATES:
        k_full, k_early = chosen_k(full, model, rate, max_k), chosen_k(early, model, rate, max_k)
        print(f"acceptance {rate}: chosen k {k_full} (measured table), {k_early} (from T(1), T(2) and the model)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="", help="comma-separated model specs (a .gguf, a directory, a name)")
    parser.add_argument("--weights", default="float", help="the targets' --weights (gguf: the file's own blocks)")
    parser.add_argument("--tiny", action="store_true", help="tiny random dense and MoE models (a smoke run)")
    parser.add_argument("--context", type=int, default=256, help="context tokens before the timed passes")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    from fastdecode.backends import make_target

    runs = [(name, make_target(model, "native"), ids) for name, model, ids in tiny_models()] if args.tiny else []
    for spec in filter(None, args.models.split(",")):
        runs.append((spec, *spec_model(spec, args.weights)))
    if not runs:
        parser.error("give --models or --tiny")
    for name, target, ids in runs:
        report(name, target, measure(target, ids, args.context, args.max_k, args.reps), args.max_k)


if __name__ == "__main__":
    main()
