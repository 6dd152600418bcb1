"""Probe: H2O with each evicted token's value merged into a kept token's, not dropped (D2O / CaM's
idea: Wan et al. 2024, Zhang et al. 2024), through ``kv_eval.stream_nll`` (the engine's policy
code path) with ``kv_policy.make_room`` patched for the run. Quality only, float32 cache, 512 slots,
the first 2,048 tokens of WikiText-2 test (``--text wiki``) or of the shipped Tiny Shakespeare
(``shak``); session 17's figures (docs/benchmarks.md §20) came from it.

Variants (``--variants``): ``none`` (today's H2O); ``avg@T``: each evicted token's value averaged
into the kept token (not a sink) whose key is nearest by cosine, if that cosine is at least T,
weighted by the two tokens' H2O scores; ``avgk@T``: the keys averaged the same way too.

    PYTHONPATH=src python scripts/h2o_merge_probe.py --text wiki --variants none,avg@0.9
    PYTHONPATH=src python scripts/h2o_merge_probe.py --variants avg@0.95 --modes 'h2o:0.2;h2o:0.2,0.5,4,1'
"""

import argparse
import math
import time

import torch

from fastdecode.args import EngineArgs
from fastdecode.data.corpora import calibration_text, evaluation_text
from fastdecode.evaluation import kv_policies as kv_eval
from fastdecode.evaluation.quality import tokenize
from fastdecode.kv import policy as kp

MODE = {"kind": "none", "thresh": -1.0}


def merge_lane(cache, table, state, scores, keep, layer: int, head: int) -> None:
    """Merge the lane's evicted slots into its kept ones, in the cache's pools (float caches)."""
    m, B = state.num_kept, cache.pool.block_size
    slots = torch.arange(m)
    blocks = torch.as_tensor(list(table.blocks), dtype=torch.long)
    blk, off = blocks[slots // B], slots % B
    kpool, vpool = cache.k[layer], cache.v[layer]
    kept = keep[layer, head]
    evicted = slots[~torch.isin(slots, kept)]
    cand = kept[kept >= state.keep_first]  # never into a sink
    if not len(evicted) or not len(cand):
        return
    k, v = kpool[blk, head, off].double(), vpool[blk, head, off].double()  # [m, D]
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-9)
    best, nearest = (unit[evicted] @ unit[cand].T).max(-1)
    for e, cos, j in zip(evicted.tolist(), best.tolist(), nearest.tolist()):
        if cos < MODE["thresh"]:
            continue
        t = int(cand[j])
        se, st = float(scores[layer, head, e]), float(scores[layer, head, t])
        w = se / (se + st) if se + st > 0 else 0.5
        v[t] = (1 - w) * v[t] + w * v[e]
        vpool[blk[t], head, off[t]] = v[t].to(vpool.dtype)
        if MODE["kind"] == "avgk":
            k[t] = (1 - w) * k[t] + w * k[e]
            kpool[blk[t], head, off[t]] = k[t].to(kpool.dtype)


def merge_make_room(executor, cache, table, state, num_computed) -> None:
    state.sync(num_computed)
    if state.room() > 0:
        return
    keep = state.keep()  # [layers, KV, kept]
    if MODE["kind"] != "none" and keep.dim() == 3:
        scores = kp.h2o_scores(state)
        for layer in range(keep.shape[0]):
            for head in range(keep.shape[1]):
                merge_lane(cache, table, state, scores, keep, layer, head)
    kp.compact(executor, cache, table, keep)
    state.evicted(keep)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default="wiki")
    p.add_argument("--variants", default="none,avg@0.9")
    p.add_argument("--modes", default="h2o:0.2")
    a = p.parse_args()
    torch.set_num_threads(1)
    args = EngineArgs(model="smollm2-135m", threads=1)
    model, tokenizer = args.load_model()
    target = args.create_target(model)
    ids = tokenize(tokenizer, evaluation_text() if a.text == "wiki" else calibration_text())[:2048]
    kv_eval.make_room = merge_make_room
    for variant in a.variants.split(","):
        kind, _, thresh = variant.partition("@")
        MODE["kind"], MODE["thresh"] = kind, float(thresh) if thresh else -1.0
        for mode in a.modes.split(";"):
            t = time.time()
            nll, count = kv_eval.stream_nll(target, ids, mode, 512)
            print(
                f"{a.text} {variant:10s} {mode:18s} {math.exp(nll / count):8.3f}  ({time.time() - t:.0f}s)", flush=True
            )


if __name__ == "__main__":
    main()
