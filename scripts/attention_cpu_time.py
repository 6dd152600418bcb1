"""CPU time of the attention alone (``fd_attention_f32`` through ctypes) at a long context, in
SmolLM2-135M's shapes (9 query heads over 3 KV heads, head_dim 64): one decode row (or
``--rows`` verification rows) at ``--positions`` positions, over 30 layers' K and V pools in
16-position blocks (the engine's), so each call streams its layer's cache as a decode step does.

Prints, per cache type, the best time of one call a layer (``--repeats`` passes over every
layer). ``--threads 1`` (default): process CPU time, the least disturbed by a shared machine;
one thread runs the kernel's item-by-item path (each query's values alone). ``--threads 2``: wall
time of the phased path a 2-core decode step takes (scores split by positions, then softmax, then
values by a KV group's queries together on zmm).

``--phased`` times the phased path itself on one thread instead (``scripts/attention_phases.c``,
built against each source; the quantized types on zmm where ``--impl`` is auto or avx512_vnni and
the CPU has it): the closest one-thread proxy for a 2-core decode step's attention.

``--sources a/cpu.c,b/cpu.c`` builds each checkout's ``cpu.c`` (with this tree's flags,
``kernels.build.cflags()``) and alternates them in one process, so drift on a shared machine
hits each alike, and says whether their outputs' bits agree (the quantized types' bits may
differ between kernels that sum in another order; row invariance is the tests' business).

    PYTHONPATH=src python scripts/attention_cpu_time.py [--types float32,float16,q8_0,q4_0]
        [--positions 4096] [--rows 1] [--threads 1] [--repeats 7] [--impl auto|avx2|avx512_vnni]
        [--phased] [--sources /path/to/old/src/fastdecode/kernels/cpu.c,src/fastdecode/kernels/cpu.c]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fastdecode.kernels.abi import IMPLS, bind
from fastdecode.kernels.build import SOURCE, cflags, find_compiler
from fastdecode.kernels.kv_formats import FORMATS
from fastdecode.kernels.paged import PagedRows
from fastdecode.kernels.quant import supported_impls

H, KV, D, BLOCK = 9, 3, 64, 16


def pools(name: str, layers: int, positions: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (K, V) pools [blocks, KV, BLOCK, width] of ``name`` holding random rows."""
    fmt, blocks = FORMATS[name], -(-positions // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(blocks, KV, BLOCK, D, generator=gen) * torch.rand(blocks, KV, BLOCK, 1, generator=gen) * 4
    rows = fmt.store(base).contiguous()
    return [(rows.clone(), rows.roll(1, 0).clone()) for _ in range(layers)]


def times_s(libs: list[ctypes.CDLL], name: str, args) -> tuple[list[float], bool]:
    """Best time a layer of one call per library, the libraries alternated; and whether the bits agree."""
    layers = pools(name, args.layers, args.positions + args.rows, seed=0)
    fmt = FORMATS[name]
    n, start = args.rows, args.positions
    blocks = -(-(start + n) // BLOCK)
    rows = PagedRows(
        torch.arange(start, start + n), torch.zeros(n, dtype=torch.int64), torch.arange(blocks)[None], BLOCK
    )
    q = torch.randn(n, H, D, generator=torch.Generator().manual_seed(1))
    scratch = torch.empty(rows.scores_floats(H))
    outs = [torch.empty(n, H * D) for _ in libs]
    clock = time.process_time if args.threads == 1 else time.perf_counter
    best = [float("inf")] * len(libs)
    for _ in range(args.repeats + 1):
        for i, lib in enumerate(libs):
            t0 = clock()
            for k, v in layers:
                lib.fd_attention_f32(
                    q.data_ptr(),
                    H * D,
                    D,
                    n,
                    H,
                    KV,
                    D,
                    k.data_ptr(),
                    v.data_ptr(),
                    *rows.args(),
                    D**-0.5,
                    0,
                    scratch.data_ptr(),
                    outs[i].data_ptr(),
                    fmt.code,
                    fmt.code,
                    IMPLS[args.impl],
                )  # fmt: skip (an older cpu.c without impl ignores the last argument)
            best[i] = min(best[i], (clock() - t0) / len(layers))
    return best, all(torch.equal(outs[0], o) for o in outs)


def build(source: Path, out: Path) -> ctypes.CDLL:
    subprocess.run([find_compiler(), *cflags(), str(source), "-o", str(out)], check=True)
    return bind(ctypes.CDLL(str(out)))


PHASES = Path(__file__).with_name("attention_phases.c")


def build_phases(source: Path, out: Path) -> ctypes.CDLL:
    """attention_phases.c against ``source`` (a cpu.c from before the zmm loops takes no zmm flag)."""
    zmm = ["-DFD_ZMM_ARG"] if "int64_t L, int zmm)" in source.read_text() else []
    cmd = [find_compiler(), *cflags(), *zmm, f'-DCPU_C="{source.resolve()}"', str(PHASES), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.phase_bench.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p]
    lib.phase_bench.restype = ctypes.c_double
    return lib


def phased_times_s(libs: list[ctypes.CDLL], name: str, args) -> tuple[list[float], bool]:
    """attention_phases.c's best CPU time a layer per library, alternated; and whether the bits agree."""
    zmm = int(args.impl in ("auto", "avx512_vnni") and "avx512_vnni" in supported_impls())
    outs = [torch.empty(H * D) for _ in libs]
    best = [float("inf")] * len(libs)
    for _ in range(args.repeats):
        for i, lib in enumerate(libs):
            s = lib.phase_bench(FORMATS[name].code & 3, args.positions, zmm, 3, outs[i].data_ptr())
            best[i] = min(best[i], s)
    return best, all(torch.equal(outs[0], o) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="float32,float16,q8_0,q4_0")
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--phased", action="store_true", help="the phased path on one thread (attention_phases.c)")
    ap.add_argument(
        "--impl", default="auto", choices=list(IMPLS), help="avx512_vnni: the zmm loops; avx2: the ymm ones"
    )
    ap.add_argument("--sources", default=str(SOURCE), help="','-separated cpu.c paths, one build each, alternated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # the kernel shares torch's OpenMP pool
    sources = [Path(s) for s in args.sources.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        make = build_phases if args.phased else build
        libs = [make(s, Path(tmp) / f"attention{i}.so") for i, s in enumerate(sources)]
        clock = "CPU" if args.threads == 1 or args.phased else "wall"
        path = "phased path, 1 thread" if args.phased else f"{args.rows} row(s), {args.threads} thread(s)"
        print(f"{args.positions} positions, {path}: {clock} ms a layer")
        print(" | ".join(str(s) for s in sources))
        for name in args.types.split(","):
            best, same = (phased_times_s if args.phased else times_s)(libs, name, args)
            line = f"{name:8} " + " | ".join(f"{t * 1e3:.3f}" for t in best)
            if len(libs) > 1:
                line += f"   new/old {best[-1] / best[0]:.3f}" + ("" if same else "  (bits differ)")
            print(line)


if __name__ == "__main__":
    main()
