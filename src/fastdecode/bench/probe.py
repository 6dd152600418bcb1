"""``fastdecode probe``: memory bandwidth and forward-pass cost per backend and weight precision.

Decoding streams every weight once per step, so its ceiling is
``bandwidth / weight bytes``; speculative decoding pays off when scoring K+1
tokens costs little more than scoring one. This measures both: a read
bandwidth probe, then for each target the median time of a 1-token and an
8-token forward over a 256-token context, the weight bytes a step streams, and
the bandwidth a decode step achieves (weight bytes / 1-token time), and the
target's perplexity on the built-in calibration text (how far a weight
precision moved the model's predictions). For the
GGUF block formats (``--weights q8_0,q4_0,q4_1,gguf``) it also times the
integer-dot-product GEMMs alone: every linear layer of a step, 1 row and 8 rows.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from fastdecode.args import EngineArgs
from fastdecode.backends.base import Executor, PagedSequence, SequenceModel
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
    perplexity: float | None = None  # on the built-in text (quant.api.default_calibration_text)

    @property
    def verify_ratio(self) -> float:
        return self.forward_8_ms / self.forward_1_ms

    @property
    def bound_tokens_per_s(self) -> float:
        return 1000.0 / self.forward_1_ms

    def achieved_gb_s(self) -> float:
        return self.weight_bytes / (self.forward_1_ms / 1000.0) / 1e9


def one_sequence(target: Executor | SequenceModel) -> tuple[Executor, SequenceModel]:
    """``target``'s executor and one sequence on it: a transformers target is one itself, any other
    executor runs one in a :class:`PagedSequence` (given one, its executor)."""
    if isinstance(target, PagedSequence):
        return target.executor, target
    if isinstance(target, SequenceModel):
        return target, target
    return target, PagedSequence(target)


def forward_cost(target: Executor | SequenceModel, dtype: str, context: int = 256, repeats: int = 21) -> ForwardCost:
    """Median times of a 1-token and an 8-token forward after ``context`` tokens, on one sequence of
    ``target`` (:func:`one_sequence`). The two are timed alternately, so drift on a shared machine hits
    both alike and their ratio stays meaningful."""
    executor, seq = one_sequence(target)
    context = max(1, min(context, seq.context_length - 8))  # a model with a short context is timed at what it holds

    def tokens(first: int, n: int) -> list[int]:  # any ids the vocabulary has
        return [(first + i) % seq.vocab_size for i in range(n)]

    def once_s(n: int) -> float:
        seq.truncate(context)
        t0 = time.perf_counter()
        seq.forward(tokens(5, n), n)
        return time.perf_counter() - t0

    seq.reset()
    seq.forward(tokens(100, context), 1)
    once_s(1), once_s(8)  # warm-up
    one, eight = [], []
    for _ in range(repeats):
        one.append(once_s(1))
        eight.append(once_s(8))
    return ForwardCost(
        executor.name,
        executor.weights,
        executor.float_kernel or "-",
        dtype,
        executor.weight_bytes(),
        statistics.median(one) * 1000,
        statistics.median(eight) * 1000,
    )


@torch.inference_mode()
def target_perplexity(target: Executor | SequenceModel, tokenizer, text: str, max_tokens: int = 512) -> float:
    """exp(mean next-token NLL) over the first ``max_tokens`` tokens of ``text``, scored by ``target``
    in one pass (``fastdecode.quant.quality.perplexity`` for a target rather than a model)."""
    import math

    _, seq = one_sequence(target)
    ids = tokenizer(text)["input_ids"][: min(max_tokens, seq.context_length)]
    if len(ids) < 2:
        raise ValueError("perplexity needs a text of at least two tokens")
    seq.reset()
    logits = seq.forward(ids, len(ids))[:-1].float()  # [n - 1, vocab]
    seq.reset()
    return math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))


@dataclass
class KernelCost:
    """The block-format GEMMs of one decode step alone: every linear layer (LM head included)
    once, on 1 row and on 8 rows: the C kernel called with its buffers allocated once, as a
    pass's C code calls it (the torch reference: one Python call a layer)."""

    weights: str  # the numeric model (target.weights)
    kernel: str  # "qdot" (C) or "torch" (the reference)
    weight_bytes: int
    gemm_1_ms: float
    gemm_8_ms: float

    @property
    def ratio(self) -> float:
        return self.gemm_8_ms / self.gemm_1_ms

    def achieved_gb_s(self) -> float:
        return self.weight_bytes / (self.gemm_1_ms / 1000.0) / 1e9


def block_kernel_cost(target, repeats: int = 21) -> KernelCost:
    """Median time of one step's GEMMs on a native target with packed-kernel weights (GGUF blocks,
    2:4 sparse q8_0, w8a8, bf16), 1 and 8 rows, timed alternately."""
    from fastdecode.backends.linear import linear_weight_bytes
    from fastdecode.formats.gguf import BlockLinear
    from fastdecode.formats.half import HalfLinear
    from fastdecode.formats.sparse import Sparse24Linear
    from fastdecode.formats.w8a8 import W8A8NativeLinear

    layers = [f for layer in target.layers for f in layer.linears()] + [target.lm_head]
    if not all(isinstance(f, (BlockLinear, Sparse24Linear, W8A8NativeLinear, HalfLinear)) for f in layers):
        raise ConfigError("block_kernel_cost needs a native target with integer-kernel weights (q8_0, q4_1, w8a8, ...)")
    gen = torch.Generator().manual_seed(0)

    def call(f, x):  # Python's checks and allocations around each call would be timed too
        projection = f.layer_projection()
        return (lambda: f(x)) if projection is None else projection.prepared(x)

    calls = {n: [call(f, torch.randn(n, f.in_features, generator=gen)) for f in layers] for n in (1, 8)}

    def once_s(n: int) -> float:
        t0 = time.perf_counter()
        for run in calls[n]:
            run()
        return time.perf_counter() - t0

    once_s(1), once_s(8)
    one, eight = [], []
    for _ in range(repeats):
        one.append(once_s(1))
        eight.append(once_s(8))
    return KernelCost(
        target.weights,
        target.float_kernel or "-",
        sum(linear_weight_bytes(f) for f in layers),
        statistics.median(one) * 1000,
        statistics.median(eight) * 1000,
    )


def _measure(args) -> tuple[list[ForwardCost], list[KernelCost]]:
    """Every (dtype, backend, weights, float kernel) the options name, once each."""
    from fastdecode.backends import BLOCK_PRECISIONS
    from fastdecode.quant.api import default_calibration_text

    rows, kernel_rows = [], []
    for dtype in args.dtype.split(","):
        # One load per dtype: a target leaves the model as it was (a low-bit
        # transformers target quantizes a copy; native fusion is idempotent).
        engine_args = EngineArgs.from_cli_args(args, dtype=dtype, backend="auto", weights="float", float_kernel="auto")
        model, tokenizer = engine_args.load_model()
        seen = set()
        for backend in args.backend.split(","):
            for weights in args.weights.split(","):
                if backend == "hf" and weights in BLOCK_PRECISIONS:
                    continue  # the block formats run on the native decoder only
                if backend == "hf" and args.kv_cache_dtype != "auto":
                    continue  # transformers keeps the model's dtype in its cache
                for float_kernel in args.float_kernel.split(","):
                    target = dataclasses.replace(
                        engine_args, backend=backend, weights=weights, float_kernel=float_kernel
                    ).create_target(model, tokenizer)
                    key = (target.name, target.weights, target.float_kernel)
                    if key in seen:  # the kernel choice only matters for native float and int8 weights
                        continue
                    seen.add(key)
                    cost = forward_cost(target, dtype)
                    cost.perplexity = target_perplexity(target, tokenizer, default_calibration_text())
                    rows.append(cost)
                    if weights in BLOCK_PRECISIONS and target.name == "native":
                        kernel_rows.append(block_kernel_cost(target))
    return rows, kernel_rows


def _print_tables(
    console, title: str, rows: list[ForwardCost], kernel_rows: list[KernelCost], bandwidth: float
) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "backend",
        "weights",
        "kernel",
        "dtype",
        "weight MB",
        "1-token ms",
        "8-token ms",
        "8/1",
        "achieved GB/s",
        "% of probe",
        "perplexity",
    ):
        table.add_column(col, justify="right")
    for cost in rows:
        table.add_row(
            cost.backend,
            cost.weights,
            cost.float_kernel,
            cost.dtype,
            f"{cost.weight_bytes / 1e6:.0f}",
            f"{cost.forward_1_ms:.1f}",
            f"{cost.forward_8_ms:.1f}",
            f"{cost.verify_ratio:.2f}",
            f"{cost.achieved_gb_s():.1f}",
            f"{100 * cost.achieved_gb_s() / bandwidth:.0f}%",
            f"{cost.perplexity:.3f}",
        )
    console.print(table)
    if kernel_rows:
        ktable = Table(title="GGUF block GEMMs alone (every linear layer of a step)")
        for col in ("weights", "kernel", "weight MB", "1-row ms", "8-row ms", "8/1", "achieved GB/s", "% of probe"):
            ktable.add_column(col, justify="right")
        for k in kernel_rows:
            ktable.add_row(
                k.weights,
                k.kernel,
                f"{k.weight_bytes / 1e6:.0f}",
                f"{k.gemm_1_ms:.2f}",
                f"{k.gemm_8_ms:.2f}",
                f"{k.ratio:.2f}",
                f"{k.achieved_gb_s():.1f}",
                f"{100 * k.achieved_gb_s() / bandwidth:.0f}%",
            )
        console.print(ktable)


def _markdown(rows: list[ForwardCost], kernel_rows: list[KernelCost], bandwidth: float, cache: str) -> str:
    lines = [
        f"Read bandwidth probe: **{bandwidth:.1f} GB/s** ({torch.get_num_threads()} threads){cache}.",
        "",
        "| backend | weights | kernel | dtype | weight MB | 1-token ms | 8-token ms | 8/1 | achieved GB/s | % of probe | perplexity |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in rows:
        lines.append(
            f"| {c.backend} | {c.weights} | {c.float_kernel} | {c.dtype} | {c.weight_bytes / 1e6:.0f} | {c.forward_1_ms:.1f} | "
            f"{c.forward_8_ms:.1f} | {c.verify_ratio:.2f} | {c.achieved_gb_s():.1f} | {100 * c.achieved_gb_s() / bandwidth:.0f}% | "
            f"{c.perplexity:.3f} |"
        )
    if kernel_rows:
        lines += [
            "",
            "GGUF block GEMMs alone (every linear layer of a step):",
            "",
            "| weights | kernel | weight MB | 1-row ms | 8-row ms | 8/1 | achieved GB/s | % of probe |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for k in kernel_rows:
            lines.append(
                f"| {k.weights} | {k.kernel} | {k.weight_bytes / 1e6:.0f} | {k.gemm_1_ms:.2f} | {k.gemm_8_ms:.2f} | "
                f"{k.ratio:.2f} | {k.achieved_gb_s():.1f} | {100 * k.achieved_gb_s() / bandwidth:.0f}% |"
            )
    return "\n".join(lines) + "\n"


def cmd_probe(args) -> int:
    from rich.console import Console

    console = Console()
    if args.markdown:
        try:
            open(args.markdown, "a").close()
        except OSError as exc:
            raise ConfigError(f"{args.markdown}: cannot write there ({exc.strerror or exc})") from None
    bandwidth = bandwidth_probe_gb_s()
    console.print(f"read bandwidth probe: {bandwidth:.1f} GB/s ({torch.get_num_threads()} threads)")
    cache = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache"
    rows, kernel_rows = _measure(args)
    _print_tables(console, f"forward cost, {args.model}{cache}", rows, kernel_rows, bandwidth)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(_markdown(rows, kernel_rows, bandwidth, cache))
    return 0


def add_probe_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "probe", help="memory bandwidth and 1- vs 8-token forward cost per backend and weight precision"
    )
    EngineArgs.add_cli_args(
        p,
        only=("model", "dtype", "backend", "weights", "float_kernel", "kv_cache_dtype"),
        sweep=("dtype", "backend", "weights", "float_kernel"),
        defaults={"backend": "hf,native", "weights": "float,int8,int4"},
        help_text={
            "weights": "comma-separated: {} (the GGUF block formats: native backend only, their GEMMs also "
            "timed alone; default: %(default)s)".format(", ".join(EngineArgs.choices("weights"))),
            "kv_cache_dtype": "what the native targets' KV cache holds (default: the model's dtype; hf rows "
            "are skipped otherwise)",
        },
    )
    p.add_argument("--markdown", default=None, help="also write the table as Markdown to this file")
    p.set_defaults(func=cmd_probe)
