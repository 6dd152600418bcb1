"""Where an N-request decode step goes, per weight format: the decoder's GEMMs, the LM head, the
rest of the layers (attention over each request's cache, norms, RoPE, activation quantization,
GLU) and everything outside the layers (sampling, logits processors, the engine's Python).

One thread by default (``--threads``: a step's parallel parts then take its wall time alone), the
configurations alternated round by round in one process. Each round decodes ``--tokens`` tokens
for ``--batch`` requests (``scripts/decode_ab.py``'s prompts) and times, per step, the fused layer
stack (``LayerStack`` calls) and the LM head (the ``Projection`` calls outside it); then
the decoder's projections alone are called on ``--batch`` rows of random activations with the
very weights the engine holds (every layer's qkv, o, gate_up and down), best of a few passes.
"rest of layers" = layer stack - decoder GEMMs. The last column says how fast the first
configuration's decoder GEMMs would have to be against each other's for that other one's step to
reach ``--target`` times the first's, all else as measured (issue 27's 1.3x at eight requests).

    PYTHONPATH=src python scripts/batch_step_split.py --configs q8_0,sparse24 --batch 8 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_ab import decode_tps  # noqa: E402 (the same prompts and settings as decode_ab)

from fastdecode.args import EngineArgs  # noqa: E402
from fastdecode.engine import GenerationConfig  # noqa: E402
from fastdecode.kernels import layer as layer_kernels  # noqa: E402


class Clock:
    """Per decode step (a pass of ``rows`` rows): when its layer stack began, the seconds in the
    stack and in projections called outside it (the LM head). Prefill passes are left out."""

    def __init__(self, rows: int) -> None:
        self.rows, self.inside = rows, False
        self.reset()

    def reset(self) -> None:
        self.starts, self.stack, self.head = [], [], []

    def step_ms(self) -> tuple[float, float, float]:
        """Median ms a step: the whole step (start to next start), the stack, the head."""
        gaps = [b - a for a, b in zip(self.starts, self.starts[1:])]
        return tuple(1e3 * statistics.median(v) for v in (gaps, self.stack, self.head))

    def install(self) -> None:
        stack_call, proj_call = layer_kernels.LayerStack.__call__, layer_kernels.Projection.__call__
        clock = self

        def timed_stack(self_, x, *args, **kwargs):
            if x.shape[0] != clock.rows:
                return stack_call(self_, x, *args, **kwargs)
            t, clock.inside = time.perf_counter(), True
            try:
                return stack_call(self_, x, *args, **kwargs)
            finally:
                clock.inside = False
                clock.starts.append(t)
                clock.stack.append(time.perf_counter() - t)

        def timed_proj(self_, x, *args, **kwargs):
            if clock.inside or x.shape[0] != clock.rows:
                return proj_call(self_, x, *args, **kwargs)
            t = time.perf_counter()
            try:
                return proj_call(self_, x, *args, **kwargs)
            finally:
                clock.head.append(time.perf_counter() - t)

        layer_kernels.LayerStack.__call__ = timed_stack
        layer_kernels.Projection.__call__ = timed_proj


def build(weights: str, threads: int):
    args = EngineArgs(model="smollm2-135m", weights=weights, threads=threads)
    model, tokenizer = args.load_model()
    target = args.create_target(model)
    engine = args.create_engine(GenerationConfig(max_new_tokens=8), model=model, tokenizer=tokenizer, target=target)
    return engine, target


def decoder_gemm_ms(target, rows: int, repeats: int = 5) -> float:
    """Best time of one pass over every decoder projection at ``rows`` rows (the engine's weights)."""
    projections = [f for layer in target.layers for f in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    inputs = [torch.randn(rows, f.in_features) for f in projections]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for f, x in zip(projections, inputs):
            f(x)
        best = min(best, time.perf_counter() - t)
    return 1e3 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="q8_0,sparse24")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target", type=float, default=1.3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = Clock(args.batch)
    clock.install()
    built = {c: build(c, args.threads) for c in args.configs.split(",")}
    rows = {c: [] for c in built}
    for engine, _ in built.values():  # warm-up
        decode_tps(engine, 8, args.batch)
    for _ in range(args.rounds):
        for c, (engine, target) in built.items():
            clock.reset()
            decode_tps(engine, args.tokens, args.batch)
            rows[c].append((*clock.step_ms(), decoder_gemm_ms(target, args.batch)))
    print(
        f"{args.batch} requests, {args.tokens} tokens each, {args.threads} thread(s), {args.rounds} rounds (medians, ms a step)"
    )
    print(
        f"{'config':12s} {'step':>7s} {'decoder GEMMs':>14s} {'LM head':>8s} {'rest of layers':>15s} {'outside layers':>15s}"
    )
    med = {c: [statistics.median(r[i] for r in rs) for i in range(4)] for c, rs in rows.items()}
    first = next(iter(med))
    for c, (step, stack, head, gemm) in med.items():
        print(f"{c:12s} {step:7.2f} {gemm:14.2f} {head:8.2f} {stack - gemm:15.2f} {step - stack - head:15.2f}")
    f_step, _, _, f_gemm = med[first]
    for c, (step, _, _, gemm) in med.items():
        if c == first:
            continue
        # the other's step with decoder GEMMs g: step - gemm + g; reaching target: f_step / that >= target
        needed = f_step / args.target - (step - gemm)
        ratio = statistics.median(a[0] / b[0] for a, b in zip(rows[first], rows[c]))
        need = f"{f_gemm / needed:.2f}x" if needed > 0 else "unreachable even at zero"
        print(
            f"{c}: step {ratio:.2f}x {first}'s (per-round median); decoder GEMMs {f_gemm / gemm:.2f}x; "
            f"{args.target}x would need its decoder GEMMs at {need} {first}'s"
        )


if __name__ == "__main__":
    main()
