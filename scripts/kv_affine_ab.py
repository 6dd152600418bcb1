"""What the q4_0 cache's key affine costs a decode step (backends/kv_calibration.py): one process,
one target (one copy of the weights), two q4_0 caches, one with the calibrated affine (keys stored as
(k - mu) / s and rounded with the error feedback, queries taken as q * s) and one without, each with ``--context`` tokens of
WikiText-2 test in its cache; rounds of ``--steps`` one-token decode steps alternate between them,
and each round's ms a step (process CPU time, so run it with ``--threads 1``; wall time too) is
paired, and (``--prefill``) so is a prefill of the context's last tokens. Prints each one's median and
the median of the per-round ratios (affine / plain).

    PYTHONPATH=src python scripts/kv_affine_ab.py --threads 1 --context 4096 --steps 32 --rounds 9
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from fastdecode.args import EngineArgs
from fastdecode.backends.base import PagedSequence
from fastdecode.data.corpora import evaluation_text
from fastdecode.evaluation.quality import tokenize


class _WithoutAffine:
    """``target`` whose caches carry no affine (the same weights and kernels)."""

    def __init__(self, target) -> None:
        self._target = target

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def new_kv_cache(self, *args, **kwargs):
        return dataclasses.replace(self._target.new_kv_cache(*args, **kwargs), k_affine=None)


def step_ms(seq: PagedSequence, context: int, tokens: list[int]) -> tuple[float, float]:
    """(CPU ms, wall ms) a one-token decode step over ``tokens``, from position ``context``."""
    seq.truncate(context)
    cpu, wall = time.process_time(), time.perf_counter()
    for t in tokens:
        seq.forward([t], 1)
    n = len(tokens)
    return 1e3 * (time.process_time() - cpu) / n, 1e3 * (time.perf_counter() - wall) / n


def prefill_ms(seq: PagedSequence, context: int, tokens: list[int]) -> tuple[float, float]:
    """(CPU ms, wall ms) a prefill of ``tokens`` as one chunk ending at position ``context``."""
    seq.truncate(context - len(tokens))
    cpu, wall = time.process_time(), time.perf_counter()
    seq.forward(tokens, 1)
    return 1e3 * (time.process_time() - cpu), 1e3 * (time.perf_counter() - wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--prefill", type=int, default=256, help="each round also prefills the context's last N tokens again"
    )
    a = p.parse_args()
    args = EngineArgs(model=a.model, weights=a.weights, kv_cache_dtype="q4_0", threads=a.threads)
    model, tokenizer = args.load_model()
    target = args.create_target(model, tokenizer)
    assert target.key_affine() is not None
    targets = {"affine": target, "plain": _WithoutAffine(target)}
    ids = tokenize(tokenizer, evaluation_text())[: a.context + a.steps]
    seqs = {}
    with torch.inference_mode():
        for name, target in targets.items():
            seqs[name] = PagedSequence(target)
            seqs[name].forward(ids[: a.context], 1)
        times = {name: [] for name in seqs}
        fills = {name: [] for name in seqs}
        for r in range(a.rounds + 1):  # round 0: warm-up
            for name, seq in sorted(seqs.items(), reverse=bool(r % 2)):  # each goes first every other round
                fill = prefill_ms(seq, a.context, ids[a.context - a.prefill : a.context]) if a.prefill else None
                ms = step_ms(seq, a.context, ids[a.context :])
                if r:
                    times[name].append(ms)
                    fills[name].append(fill)
    print(f"{a.model} {a.weights}, q4_0 cache, {a.context} tokens of context, {a.steps} steps x {a.rounds} rounds")
    for name, ms in times.items():
        cpu, wall = zip(*ms)
        print(
            f"{name:7s} CPU ms/step median {statistics.median(cpu):.3f} (min {min(cpu):.3f}, max {max(cpu):.3f});"
            f" wall median {statistics.median(wall):.3f}"
        )
    ratios = [x[0] / y[0] for x, y in zip(times["affine"], times["plain"])]
    print(
        f"affine / plain CPU per round: median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})"
    )
    if a.prefill:
        for name, ms in fills.items():
            print(f"{name:7s} prefill of {a.prefill} tokens, CPU ms median {statistics.median(m[0] for m in ms):.1f}")
        ratios = [x[0] / y[0] for x, y in zip(fills["affine"], fills["plain"])]
        print(
            f"affine / plain prefill CPU per round: median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})"
        )


if __name__ == "__main__":
    main()
