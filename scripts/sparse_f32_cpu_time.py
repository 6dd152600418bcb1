"""CPU time of the float32 GEMMs alone, dense (``rowgemm``) against 2:4 sparse float32
(``kernels/sparse_f32.c``, each implementation), one thread: 30 layers of random 2:4-pruned weights
in SmolLM2-135M's shapes (q/k/v, o, gate/up, down; the LM head left out), larger than the L3
cache, so each call streams its weights from memory. The three alternate 7 times; prints the
median CPU time of one pass over every layer, per row count.

    PYTHONPATH=src python scripts/sparse_f32_cpu_time.py [ROWS ...]   (default: 1 8 64)
"""

import sys
import time

import torch

from fastdecode.kernels.quant import Projection, supported_impls
from fastdecode.kernels.sparse import pack_s24_f32
from fastdecode.quant.sparsity import nm_mask

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]: qkv, o, gate_up, down


def layers(impls):
    out = []
    for _ in range(30):
        for n, k in SHAPES:
            w = torch.randn(n, k)
            w = torch.where(nm_mask(w.abs(), 2, 4), w, torch.zeros(()))
            packed = pack_s24_f32(w)
            out.append(
                {"dense": Projection([(w, None)], None, k)} | {i: Projection([packed], None, k, impl=i) for i in impls}
            )
    return out


def main() -> None:
    torch.set_num_threads(1)
    impls = [i for i in ("avx512_vnni", "avx2") if i in supported_impls()]
    model = layers(impls)
    for rows in [int(a) for a in sys.argv[1:]] or [1, 8, 64]:
        runs = {name: [p[name].prepared(torch.randn(rows, p[name].in_features)) for p in model] for name in model[0]}
        times = {name: [] for name in runs}
        for _ in range(7):
            for name, calls in runs.items():
                t = time.thread_time()
                for call in calls:
                    call()
                times[name].append(time.thread_time() - t)
        print(rows, "rows:", ", ".join(f"{n} {sorted(t)[3] * 1e3:.2f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
