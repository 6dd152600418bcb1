"""Compute-bound time of the block GEMMs: one SmolLM2-135M layer's projections (q/k/v, o, gate/up,
down; ~2.4 MB at q8_0, in cache), called 40 times a round, one thread, CPU time, builds of
``cpu.c`` with each variant's extra flags alternated round by round; prints the median over the
rounds of ns a block-row (8 outputs x 32 weights x 1 row) per variant, and whether the bits agree.
Where ``block_gemm_cpu_time.py`` times a model streamed from memory, this isolates the
instructions (what an 8-row pass is bound by), so a kernel change shows through a loaded host.

    PYTHONPATH=src python scripts/block_gemm_in_cache.py sparse24 8,4,1 ";-DSOME_FLAG" [impl]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import block_gemm_cpu_time as B  # noqa: E402


def main() -> None:
    fmt, rows_list, variants = sys.argv[1], [int(r) for r in sys.argv[2].split(",")], sys.argv[3].split(";")
    impl = sys.argv[4] if len(sys.argv) > 4 else "auto"
    torch.set_num_threads(1)  # the kernel shares torch's OpenMP pool
    shapes = B.layer_shapes(1, False)
    block_rows = sum(-(-n // 8) * -(-k // 32) for n, k in shapes)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [B.build_variant(v.split(), Path(tmp), i) for i, v in enumerate(variants)]
        projs = B.build(fmt, shapes, None, [impl])[0]
        for rows in rows_list:
            xs = [torch.randn(rows, k) for _, k in shapes]
            ys = [torch.empty(rows, n) for n, _ in shapes]
            scratch = torch.empty(max(p.scratch_bytes(rows) for p in projs), dtype=torch.uint8)
            ns: list[list[float]] = [[] for _ in libs]
            outs = []
            for rnd in range(15):
                for i, lib in enumerate(libs):
                    t0 = time.process_time()
                    for _ in range(40):
                        for x, y, p in zip(xs, ys, projs):
                            lib.fd_project(x.data_ptr(), rows, p.in_features, p.ref, scratch.data_ptr(), y.data_ptr())
                    ns[i].append((time.process_time() - t0) / 40 * 1e9 / (block_rows * rows))
                    if rnd == 0:
                        outs.append(torch.cat([y.flatten() for y in ys]).clone())
            same = all(torch.equal(outs[0], o) for o in outs)
            cells = " | ".join(f"{v or '(none)'}: {statistics.median(r):.3f}" for v, r in zip(variants, ns))
            print(f"{fmt} {impl} {rows} rows, ns a block-row: {cells}" + ("" if same else "  BITS DIFFER"))


if __name__ == "__main__":
    main()
