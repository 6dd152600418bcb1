"""CPU time of the GGUF block GEMMs alone (``fd_project`` called through ctypes with its
scratch and output allocated once), one thread: a model's worth of random weights in
SmolLM2-135M's shapes (30 layers of q/k/v, o, gate/up, down, then the 49152 x 576 LM head),
larger than the L3 cache, so each call streams its weights from memory.

Prints, per format and row count, the best process CPU time of one pass over every layer,
ns a block-row (8 outputs x 32 weights x 1 row) and the single-thread bandwidth. CPU time
(``time.process_time``), not wall time, so a loaded machine inflates it less; on a quiet
machine compare against ``fastdecode probe``'s read bandwidth.

    PYTHONPATH=src python scripts/block_gemm_cpu_time.py [--formats q4_1,q4_0,q8_0] [--rows 1,8] [--layers 30]

``--shape llama-3.2-1b --layers 16`` takes a make-gguf trunk's shapes instead (the K-quants need rows of
256 weights, which SmolLM2's 576 are not). A GGUF type fastdecode does not quantize to (``mxfp4``, ``iq4_nl``, ``q4_k``, ...) takes ``make-gguf``'s
random blocks of that type (``fastdecode.bench.synthetic_gguf.random_weight``): the kernels' speed
depends on the shapes and the type, not on the values.

``--head q8_0`` gives the LM head its own format (the embedded SmolLM2-135M Q4_1 GGUF: Q4_1 layers,
a Q8_0 head). Format ``sparse24`` is 2:4-pruned weights in the 2:4 sparse Q8_0 layout (compare it with
``q8_0`` on the same shapes). Format ``w8a8`` is int8 per output channel x int8 activations per token
(``kernels/w8a8.c``), ``int8`` weight-only int8 per channel on the float32 row-invariant GEMM. ``--impls avx2,avx512_vnni`` times each implementation of
``kernels.quant.IMPLS`` that runs here, alternated in one process (default: ``auto``, what decoding takes).

``--variants="-DQPREFETCH_BYTES=2048;-DQPREFETCH_BYTES=8192"`` instead builds ``cpu.c`` once per
variant (this machine's flags, ``kernels.build.cflags()``, plus those) and alternates the builds in one process, so drift on a shared machine hits each
alike (best of ``--repeats``), and says whether their outputs' bits agree.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fastdecode.bench.synthetic_gguf import SHAPES, random_weight
from fastdecode.kernels import quant
from fastdecode.kernels.abi import bind
from fastdecode.kernels.build import SOURCE, find_compiler
from fastdecode.kernels.gguf_blocks import FORMATS, BlockTensor, file_blocks
from fastdecode.kernels.gguf_types import BLOCK_FORMATS
from fastdecode.kernels.library import kernel
from fastdecode.kernels.sparse import pack_s24
from fastdecode.kernels.w8a8 import pack_w8a8
from fastdecode.quant.math import quantize_int8_per_channel
from fastdecode.quant.sparsity import nm_mask

try:
    from fastdecode.kernels.build import cflags
except ImportError:  # a tree from before AVX-VNNI builds (PYTHONPATH at an older checkout, to compare)
    from fastdecode.kernels.build import CFLAGS

    def cflags() -> tuple[str, ...]:
        return CFLAGS


HIDDEN, INTER, KV_OUT, VOCAB = 576, 1536, 192, 49152


def layer_shapes(layers: int, head: bool, shape: str | None = None) -> list[tuple[int, int]]:
    """[out, in] of each projection: SmolLM2-135M's, or those of make-gguf's ``shape``."""
    hidden, inter, kv_out, q_out = HIDDEN, INTER, KV_OUT, HIDDEN
    if shape:
        s = SHAPES[shape]
        hidden, inter, kv_out = s.hidden_size, s.intermediate_size, s.num_kv_heads * s.head_dim
        q_out = s.num_heads * s.head_dim
    per_layer = [(q_out + 2 * kv_out, hidden), (hidden, q_out), (2 * inter, hidden), (hidden, inter)]
    return per_layer * layers + ([(VOCAB, hidden)] if head else [])


def build(fmt: str, shapes: list[tuple[int, int]], head: str | None, impls: list[str]) -> list[list[quant.Projection]]:
    """Per implementation, one projection a shape (the last, the LM head, in ``head``'s format when given)."""
    gen = torch.Generator().manual_seed(0)
    cache: dict[tuple[int, int, str], object] = {}
    packed = []
    for i, (n, k) in enumerate(shapes):
        f = head if head and i == len(shapes) - 1 and n == VOCAB else fmt
        if (n, k, f) not in cache:  # one quantization a shape; each layer its own packed copy (memory-sized)
            w = torch.randn(n, k, generator=gen) * 0.05
            if f == "sparse24":
                cache[(n, k, f)] = BlockTensor.quantize(w * nm_mask(w.abs(), 2, 4), "q8_0")
            elif f in ("w8a8", "int8"):
                cache[(n, k, f)] = quantize_int8_per_channel(w, float32_scales=True)
            elif f in FORMATS:
                cache[(n, k, f)] = BlockTensor.quantize(w, f)
            else:  # a file's type: make-gguf's random blocks of it
                raw = random_weight(f, n, k, np.random.default_rng(i))
                cache[(n, k, f)] = file_blocks(BLOCK_FORMATS[f].ggml_type, raw, k)
        packed.append((_part(f, cache[(n, k, f)]), k))
    return [[quant.Projection([p], None, k, impl) for p, k in packed] for impl in impls]


def _part(fmt: str, weights):
    """A fresh packed copy of one layer's weights in ``fmt`` (an int8 part: (q, scales))."""
    if fmt == "sparse24":
        return pack_s24(weights)
    if fmt == "w8a8":
        return pack_w8a8(*weights)
    if fmt == "int8":
        return weights[0].clone(), weights[1].clone()
    return quant.pack(weights)


def _weight_bytes(p: quant.Projection) -> int:
    return sum(t.numel() * t.element_size() for t in p._keep)


def cpu_times_s(
    runs: list[tuple[ctypes.CDLL, list[quant.Projection]]], rows: int, repeats: int
) -> tuple[list[float], bool]:
    """Best CPU time of one pass over each run's projections with its library, the runs alternated;
    and whether they gave the same bits."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(p.in_features, p.out_features) for p in runs[0][1]]
    xs = [torch.randn(rows, k, generator=gen) for k, _ in shapes]
    ys = [torch.empty(rows, n) for _, n in shapes]
    scratch = torch.empty(max(1, max(p.scratch_bytes(rows) for p in runs[0][1])), dtype=torch.uint8)
    best, outputs = [float("inf")] * len(runs), []
    for it in range(repeats + 1):
        for i, (lib, projections) in enumerate(runs):
            t0 = time.process_time()
            for x, y, p in zip(xs, ys, projections):
                lib.fd_project(x.data_ptr(), rows, p.in_features, p.ref, scratch.data_ptr(), y.data_ptr())
            best[i] = min(best[i], time.process_time() - t0)
            if it == 0:
                outputs.append(torch.cat([y.flatten() for y in ys]))
    return best, all(torch.equal(outputs[0], o) for o in outputs)


def build_variant(flags: list[str], out_dir: Path, tag: int) -> ctypes.CDLL:
    out = out_dir / f"variant{tag}.so"
    subprocess.run([find_compiler(), *cflags(), *flags, str(SOURCE), "-o", str(out)], check=True)
    return bind(ctypes.CDLL(str(out)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q4_1,q4_0,q8_0", help="block formats, or sparse24")
    ap.add_argument("--head", default=None, help="the LM head's format (default: the layers')")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument(
        "--shape", default=None, choices=sorted(SHAPES), help="make-gguf's shapes instead of SmolLM2-135M's"
    )
    ap.add_argument("--no-head", action="store_true", help="leave out the LM head")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--impls", default="auto", help="','-separated kernels.quant.IMPLS, alternated")
    ap.add_argument("--variants", default=None, help="';'-separated extra compiler flags, one build each, alternated")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the kernel shares torch's OpenMP pool
    shapes = layer_shapes(args.layers, not args.no_head, args.shape)
    rows_list = [int(r) for r in args.rows.split(",")]
    impls = [i for i in args.impls.split(",") if i == "auto" or i in quant.supported_impls()]
    with tempfile.TemporaryDirectory() as tmp:
        if args.variants is None:
            libs, names = [kernel()], [""]
        else:
            variants = [v.split() for v in args.variants.split(";")]
            libs = [build_variant(flags, Path(tmp), i) for i, flags in enumerate(variants)]
            names = [" ".join(v) or "(none)" for v in variants]
        names = [f"{impl} {name}".strip() for impl in impls for name in names]
        if len(names) > 1:
            print("ms of each: " + " | ".join(names))
        print(f"{'format':14} {'rows':>4} {'ms':>8} {'ns/block-row':>13} {'GB/s (1 thread)':>16} {'x 1-row':>8}")
        for fmt in args.formats.split(","):
            per_impl = build(fmt, shapes, args.head, impls)
            runs = [(lib, projections) for projections in per_impl for lib in libs]
            nbytes = sum(_weight_bytes(p) for p in per_impl[0])
            block_rows = sum(-(-n // 8) * -(-k // 32) for n, k in shapes)
            base = None
            label = fmt + ("+" + args.head if args.head and not args.no_head else "")
            for rows in rows_list:
                times, same = cpu_times_s(runs, rows, args.repeats)
                s = times[0]
                base = s if base is None else base
                line = f"{label:14} {rows:>4} {s * 1e3:8.2f} {s * 1e9 / (block_rows * rows):13.2f} "
                line += f"{nbytes / s / 1e9:16.1f} {s / base:8.2f}"
                if len(runs) > 1:
                    line += "   " + " | ".join(f"{t * 1e3:.2f}" for t in times) + ("" if same else "  BITS DIFFER")
                print(line)


if __name__ == "__main__":
    main()
