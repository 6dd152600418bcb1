"""``fastdecode probe``: memory bandwidth and forward-pass cost per backend and weight precision.

Decoding streams every weight once per step, so its ceiling is
``bandwidth / weight bytes``; speculative decoding pays off when scoring K+1
tokens costs little more than scoring one. This measures both: a read
bandwidth probe, then for each target the median time of a 1-token and an
8-token forward over a 256-token context, the weight bytes a step streams, and
the bandwidth a decode step achieves (weight bytes / 1-token time).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from fastdecode.errors import ConfigError


def bandwidth_probe_gb_s(size_mb: int = 512, repeats: int = 7) -> float:
    """Best read bandwidth of summing a float32 tensor larger than any cache."""
    x = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


@dataclass
class ForwardCost:
    backend: str
    weights: str
    float_kernel: str  # "rowgemm" / "torch" for native float and int8 weights, "-" otherwise
    dtype: str
    weight_bytes: int
    forward_1_ms: float
    forward_8_ms: float

    @property
    def verify_ratio(self) -> float:
        return self.forward_8_ms / self.forward_1_ms

    @property
    def bound_tokens_per_s(self) -> float:
        return 1000.0 / self.forward_1_ms

    def achieved_gb_s(self) -> float:
        return self.weight_bytes / (self.forward_1_ms / 1000.0) / 1e9


def forward_cost(target, dtype: str, context: int = 256, repeats: int = 21) -> ForwardCost:
    """Median times of a 1-token and an 8-token forward after ``context`` tokens.
    The two are timed alternately, so drift on a shared machine hits both alike
    and their ratio stays meaningful."""

    def once_s(n: int) -> float:
        target.truncate(context)
        t0 = time.perf_counter()
        target.forward(list(range(5, 5 + n)), n)
        return time.perf_counter() - t0

    target.reset()
    target.forward(list(range(100, 100 + context)), 1)
    once_s(1), once_s(8)  # warm-up
    one, eight = [], []
    for _ in range(repeats):
        one.append(once_s(1))
        eight.append(once_s(8))
    return ForwardCost(target.name, target.weights, target.float_kernel or "-", dtype, target.weight_bytes(),
                       statistics.median(one) * 1000, statistics.median(eight) * 1000)


def cmd_probe(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from fastdecode.backends import make_target
    from fastdecode.loading import load_model

    console = Console()
    if args.markdown:
        try:
            open(args.markdown, "a").close()
        except OSError as exc:
            raise ConfigError(f"{args.markdown}: cannot write there ({exc.strerror or exc})") from None
    bandwidth = bandwidth_probe_gb_s()
    console.print(f"read bandwidth probe: {bandwidth:.1f} GB/s ({torch.get_num_threads()} threads)")
    table = Table(title=f"forward cost, {args.model}")
    for col in ("backend", "weights", "kernel", "dtype", "weight MB", "1-token ms", "8-token ms", "8/1", "achieved GB/s", "% of probe"):
        table.add_column(col, justify="right")
    rows = []
    for dtype in args.dtype.split(","):
        # One load per dtype: make_target leaves the model as it was (a low-bit
        # transformers target quantizes a copy; native fusion is idempotent).
        model, _ = load_model(args.model, dtype=dtype)
        seen = set()
        for backend in args.backend.split(","):
            for weights in args.weights.split(","):
                for float_kernel in args.float_kernel.split(","):
                    target = make_target(model, backend, weights, float_kernel)
                    key = (target.name, target.weights, target.float_kernel)
                    if key in seen:  # the kernel choice only matters for native float and int8 weights
                        continue
                    seen.add(key)
                    rows.append(forward_cost(target, dtype))
    for cost in rows:
        table.add_row(cost.backend, cost.weights, cost.float_kernel, cost.dtype, f"{cost.weight_bytes / 1e6:.0f}",
                      f"{cost.forward_1_ms:.1f}", f"{cost.forward_8_ms:.1f}", f"{cost.verify_ratio:.2f}",
                      f"{cost.achieved_gb_s():.1f}", f"{100 * cost.achieved_gb_s() / bandwidth:.0f}%")
    console.print(table)
    if args.markdown:
        lines = [f"Read bandwidth probe: **{bandwidth:.1f} GB/s** ({torch.get_num_threads()} threads).", "",
                 "| backend | weights | kernel | dtype | weight MB | 1-token ms | 8-token ms | 8/1 | achieved GB/s | % of probe |",
                 "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for c in rows:
            lines.append(f"| {c.backend} | {c.weights} | {c.float_kernel} | {c.dtype} | {c.weight_bytes / 1e6:.0f} | {c.forward_1_ms:.1f} | "
                         f"{c.forward_8_ms:.1f} | {c.verify_ratio:.2f} | {c.achieved_gb_s():.1f} | {100 * c.achieved_gb_s() / bandwidth:.0f}% |")
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


def add_probe_parser(subparsers) -> None:
    p = subparsers.add_parser("probe", help="memory bandwidth and 1- vs 8-token forward cost per backend and weight precision")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", help="comma-separated")
    p.add_argument("--backend", default="hf,native", help="comma-separated: hf, native")
    p.add_argument("--weights", default="float,int8,int4", help="comma-separated: float, int8, int4")
    p.add_argument("--float-kernel", default="auto", help="comma-separated: auto, rowgemm, torch (native GEMM for float32 and int8 weights)")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown to this file")
    p.set_defaults(func=cmd_probe)
