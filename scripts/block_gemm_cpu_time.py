"""CPU time of the GGUF block GEMMs alone (``fd_project`` called through ctypes with its
scratch and output allocated once), one thread: a model's worth of random weights in
SmolLM2-135M's shapes (30 layers of q/k/v, o, gate/up, down, then the 49152 x 576 LM head),
larger than the L3 cache, so each call streams its weights from memory.

Prints, per format and row count, the best process CPU time of one pass over every layer,
ns a block-row (8 outputs x 32 weights x 1 row) and the single-thread bandwidth. CPU time
(``time.process_time``), not wall time, so a loaded machine inflates it less; on a quiet
machine compare against ``fastdecode probe``'s read bandwidth.

    PYTHONPATH=src python scripts/block_gemm_cpu_time.py [--formats q4_1,q4_0,q8_0] [--rows 1,8] [--layers 30]

``--variants="-DQPREFETCH_BYTES=2048;-DQPREFETCH_BYTES=8192"`` instead builds ``cpu.c`` once per
variant (this machine's flags, ``kernels.build.cflags()``, plus those; ``-mno-avxvnni`` turns
AVX-VNNI off) and alternates the builds in one process, so drift on a shared machine hits each
alike (best of ``--repeats``), and says whether their outputs' bits agree.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fastdecode.gguf_blocks import BlockTensor
from fastdecode.kernels import quant
from fastdecode.kernels.abi import bind
from fastdecode.kernels.build import SOURCE, find_compiler
from fastdecode.kernels.library import kernel

try:
    from fastdecode.kernels.build import cflags
except ImportError:  # a tree from before AVX-VNNI builds (PYTHONPATH at an older checkout, to compare)
    from fastdecode.kernels.build import CFLAGS

    def cflags() -> tuple[str, ...]:
        return CFLAGS


HIDDEN, INTER, KV_OUT, VOCAB = 576, 1536, 192, 49152


def layer_shapes(layers: int, head: bool) -> list[tuple[int, int]]:
    per_layer = [(HIDDEN + 2 * KV_OUT, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * layers + ([(VOCAB, HIDDEN)] if head else [])


def build(fmt: str, shapes: list[tuple[int, int]]) -> list[quant.Projection]:
    gen = torch.Generator().manual_seed(0)
    cache: dict[tuple[int, int], BlockTensor] = {}
    projections = []
    for n, k in shapes:
        if (n, k) not in cache:  # one quantization a shape; each layer its own packed copy (memory-sized)
            cache[(n, k)] = BlockTensor.quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
        projections.append(quant.Projection([quant.pack(cache[(n, k)])], None, k))
    return projections


def cpu_times_s(libs: list, projections: list[quant.Projection], rows: int, repeats: int) -> tuple[list[float], bool]:
    """Best CPU time of one pass over ``projections`` for each library, the libraries alternated;
    and whether they gave the same bits."""
    gen = torch.Generator().manual_seed(1)
    calls = []
    for p in projections:
        x = torch.randn(rows, p.in_features, generator=gen)
        y = torch.empty(rows, p.out_features)
        scratch = torch.empty(max(1, p.scratch_bytes(rows)), dtype=torch.uint8)
        calls.append((x, y, scratch, p))
    best, outputs = [float("inf")] * len(libs), []
    for it in range(repeats + 1):
        for i, lib in enumerate(libs):
            t0 = time.process_time()
            for x, y, scratch, p in calls:
                lib.fd_project(x.data_ptr(), rows, p.in_features, p.ref, scratch.data_ptr(), y.data_ptr())
            best[i] = min(best[i], time.process_time() - t0)
            if it == 0:
                outputs.append(torch.cat([c[1].flatten() for c in calls]))
    return best, all(torch.equal(outputs[0], o) for o in outputs)


def build_variant(flags: list[str], out_dir: Path, tag: int) -> ctypes.CDLL:
    out = out_dir / f"variant{tag}.so"
    subprocess.run([find_compiler(), *cflags(), *flags, str(SOURCE), "-o", str(out)], check=True)
    return bind(ctypes.CDLL(str(out)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q4_1,q4_0,q8_0")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--no-head", action="store_true", help="leave out the LM head")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--variants", default=None, help="';'-separated extra compiler flags, one build each, alternated")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the kernel shares torch's OpenMP pool
    shapes = layer_shapes(args.layers, not args.no_head)
    rows_list = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.variants is None:
            libs, names = [kernel()], ["ms"]
        else:
            variants = [v.split() for v in args.variants.split(";")]
            libs = [build_variant(flags, Path(tmp), i) for i, flags in enumerate(variants)]
            names = [" ".join(v) or "(none)" for v in variants]
            print("ms of each build: " + " | ".join(names))
        print(f"{'format':6} {'rows':>4} {'ms':>8} {'ns/block-row':>13} {'GB/s (1 thread)':>16} {'x 1-row':>8}")
        for fmt in args.formats.split(","):
            projections = build(fmt, shapes)
            nbytes = sum(p._keep[0].numel() for p in projections)
            block_rows = sum(-(-n // 8) * -(-k // 32) for n, k in shapes)
            base = None
            for rows in rows_list:
                times, same = cpu_times_s(libs, projections, rows, args.repeats)
                s = times[0]
                base = s if base is None else base
                line = f"{fmt:6} {rows:>4} {s * 1e3:8.2f} {s * 1e9 / (block_rows * rows):13.2f} "
                line += f"{nbytes / s / 1e9:16.1f} {s / base:8.2f}"
                if len(libs) > 1:
                    line += "   " + " | ".join(f"{t * 1e3:.2f}" for t in times) + ("" if same else "  BITS DIFFER")
                print(line)


if __name__ == "__main__":
    main()
