"""Speculation per prompt with the pass cost as a fixed line, so timing noise decides nothing.

The batch draft policy's T(rows) is replaced by 1 + SLOPE * (rows - 1) (float32 measured ~0.11 a
row, GGUF ~0.23); the engine then plans and guards from that line alone, and each prompt's
modeled speed-up is (plain passes) / (sum of its passes' T). Drafts, acceptances and passes are
real (the embedded SmolLM2, greedy); only the clock is modeled. Use it to compare guard or
planner changes on a shared machine, where wall-clock figures mean nothing
(docs/benchmarks.md §2.7):

    PYTHONPATH=src python scripts/guard_modeled.py --slope 0.23 --drafter ngram

The modeled policy is a ``BatchDraftPolicy`` subclass handed to the engine through its public
``policy`` setter; nothing in the library is patched.
"""

from __future__ import annotations

import argparse
import math

import torch

from fastdecode.args import EngineArgs
from fastdecode.data.suite import builtin_suite
from fastdecode.engine.policy import BatchDraftPolicy


class ModeledPolicy(BatchDraftPolicy):
    """The batch draft policy with T(rows) = 1 + slope (rows - 1) for every pass, measured or not;
    it keeps the row count of every pass it is told of (``record_forward``: one call a decoding pass)."""

    def __init__(self, slope: float) -> None:
        super().__init__()
        self.slope = slope
        self.rows_log: list[int] = []

    def cost(self, rows: int) -> float:
        return 1.0 + self.slope * (rows - 1)

    def record_forward(self, num_rows: int, seconds: float) -> None:
        self.rows_log.append(num_rows)
        super().record_forward(num_rows, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slope", type=float, default=0.11, help="a row's cost, as a fraction of a 1-row pass")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    slope = args.slope
    extra = {"ngram_n": 5} if args.drafter == "ngram" else {}
    engine_args = EngineArgs(
        model="smollm2-135m", drafter=args.drafter, draft_k=7, cost_aware_k=True, threads=1, **extra
    )
    model, tokenizer = engine_args.load_model()
    engine = engine_args.create_engine(model=model, tokenizer=tokenizer)
    policy = ModeledPolicy(slope)
    engine.policy = policy
    rows_log = policy.rows_log
    suite = builtin_suite()
    speedups = []
    for category in ("summarize", "qa", "code", "translate", "chat"):
        for i, sample in enumerate([s for s in suite if s.category == category][: args.per_category]):
            rows_log.clear()
            result = engine.generate(sample.prompt, max_new_tokens=args.max_new_tokens)
            modeled = sum(1.0 + slope * (rows - 1) for rows in rows_log)
            x = (len(result.token_ids) - 1) / modeled if modeled else 1.0
            speedups.append(x)
            a = result.acceptance
            print(
                f"{category}/{i:<3} x={x:.3f} passes {len(rows_log)} drafted {a.drafted_tokens} "
                f"accepted {a.accepted_tokens}"
            )
    geomean = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
    print(f"slope {slope} {args.drafter}: worst {min(speedups):.3f}, geometric mean {geomean:.3f}")


if __name__ == "__main__":
    main()
