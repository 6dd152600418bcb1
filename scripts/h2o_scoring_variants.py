"""H2O scoring variants, measured one at a time through ``kv_eval.stream_nll`` (the engine's
own policy code path: ``make_room`` before each pass, ``KVState.accept`` after), each variant
patched over ``fastdecode.kv_policy`` for the run only. Quality only: deterministic, exact
on a busy machine. Session 15's table (docs/benchmarks.md 11b) came from it:

    PYTHONPATH=src python scripts/h2o_scoring_variants.py --text wiki --variants base,max7,avg5
    PYTHONPATH=src python scripts/h2o_scoring_variants.py --text shak --variants pavg5,std,l1 \
        --modes 'h2o:0.2;h2o:0.5'

``--text wiki``: the first 2,048 tokens of WikiText-2 test; ``shak``: of the shipped Tiny
Shakespeare; 512-slot cache, SmolLM2-135M in float32, one thread. Variants:

- ``maxK`` / ``avgK``: SnapKV's pooling (Li et al. 2024; max 7 in its LongBench runs, avg 5 in
  its code) of each lane's mean scores over the candidates in slot order before the lowest go;
- ``pavg5`` / ``pmax7``: the same over context positions (only kept tokens within 2 / 3
  positions are neighbours; evicted ones are absent), SnapKV's pooling over a streamed cache;
- ``rownorm``: each row's value-weighted attention rescaled to sum to 1 (each row one vote);
- ``votes``: Scissorhands (Liu et al. 2023): the share of rows whose weight on the token is at
  least the row's mean weight (ties by the weight);
- ``std``: the mean plus the standard deviation over the rows that saw the token (CAKE's
  mean-and-variance indicator, Qin et al. 2025, with weight 1);
- ``l1``: VATP's l1 value norm (the paper's) instead of the l2 norm; ``l1std``: with ``std``;
  ``l1pavg5``: under ``pavg5``.
"""

import argparse
import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from fastdecode.args import EngineArgs
from fastdecode.data.corpora import calibration_text, evaluation_text
from fastdecode.evaluation.kv_policies import stream_nll
from fastdecode.evaluation.quality import tokenize
from fastdecode.kernels.kv_formats import pool_format
from fastdecode.kv import policy as kp


def pooled(kind, k, region="cand"):
    def keep(state):
        lo, hi, m = state.keep_first, state.num_kept - state.recent, state.num_kept
        s = kp.h2o_scores(state)
        x = s[..., lo:hi] if region == "cand" else s
        L, KV, n = x.shape
        x2 = x.reshape(L * KV, 1, n)
        if kind == "max":
            y = F.max_pool1d(x2, k, stride=1, padding=k // 2)
        else:
            y = F.avg_pool1d(x2, k, stride=1, padding=k // 2, count_include_pad=False)
        y = y.reshape(L, KV, n)
        scores = y if region == "cand" else y[..., lo:hi]
        dropped = lo + torch.sort(scores, dim=-1, stable=True).indices[..., : state.evict_tokens]
        kept = torch.ones(*scores.shape[:2], m, dtype=torch.bool).scatter_(-1, dropped, False)
        return torch.arange(m).expand_as(kept)[kept].view(*kept.shape[:2], m - state.evict_tokens)

    return keep


ROW = {"t": None}


def obs_call(self, q, k_pool, window, v_pool=None):
    B, KV = self.block_size, k_pool.shape[1]
    for e, first, layers in self.watch:
        n, length = len(e.token_ids), e.start + len(e.token_ids)
        t = torch.arange(length)
        blocks = torch.as_tensor(list(e.block_table), dtype=torch.long)[t // B]
        keys = pool_format(k_pool, q.shape[-1]).load(k_pool[blocks, :, t % B]).transpose(0, 1).double()
        acc = torch.zeros(n, KV, length, dtype=torch.float64)
        norms = torch.ones(KV, length, dtype=torch.float64)
        if v_pool is not None:
            norms = (
                pool_format(v_pool, q.shape[-1])
                .load(v_pool[blocks, :, t % B])
                .transpose(0, 1)
                .double()
                .norm(p=ROW.get("p", 2), dim=-1)
            )
        for i in range(n):
            p = e.start + i
            lo = 0 if window is None else max(0, p + 1 - window)
            k = keys[:, lo : p + 1].contiguous()
            qi = q[first + i].double().reshape(KV, -1, q.shape[-1])
            w = torch.softmax(torch.matmul(qi, k.transpose(1, 2)) * self.scale, dim=-1)
            acc[i, :, lo : p + 1] = ROW["t"](w, norms[:, lo : p + 1])
        layers.append(acc)


def rownorm(w, nv):
    r = w.amax(dim=1) * nv
    return r / r.sum(-1, keepdim=True)


def votes(w, nv):
    r = w.amax(dim=1) * nv
    return (r >= r.mean(-1, keepdim=True)).double() + 1e-6 * r


def sumheads_rownorm(w, nv):
    r = w.sum(dim=1) * nv
    return r / r.sum(-1, keepdim=True)


def plain(w, nv):
    return w.amax(dim=1) * nv


ROWS = {"rownorm": rownorm, "votes": votes, "l1": plain, "std": plain, "l1std": plain}
_orig_accept, _orig_sync, _orig_evicted, _orig_scores = (
    kp.KVState.accept,
    kp.KVState.sync,
    kp.KVState.evicted,
    kp.h2o_scores,
)


def std_accept(self, num_computed):
    accepted = num_computed - self.pending_start
    pend = list(self.pending)
    _orig_accept(self, num_computed)
    sq = getattr(self, "sq", None)
    if sq is None or sq.shape != self.scores.shape:
        if sq is None:
            sq = torch.zeros_like(self.scores)
        else:
            sq = sq.expand(*self.scores.shape[:2], -1).clone() if sq.shape[:2] != self.scores.shape[:2] else sq
            if sq.shape[-1] < self.scores.shape[-1]:
                sq = torch.cat([sq, sq.new_zeros(*sq.shape[:2], self.scores.shape[-1] - sq.shape[-1])], -1)
    for rows in pend:
        slots = min(rows.shape[-1], sq.shape[-1])
        for i in range(min(accepted, rows.shape[0])):
            sq[..., :slots] += rows[i, ..., :slots] ** 2
    self.sq = sq


def std_evicted(self, keep):
    _orig_evicted(self, keep)
    if getattr(self, "sq", None) is not None:
        self.sq = self.sq.gather(-1, keep.expand(*self.sq.shape[:2], -1))


def std_scores(state):
    seen = (state.num_committed - state.positions).to(torch.float64)
    mean = state.scores / seen
    var = (state.sq[..., : mean.shape[-1]] / seen - mean**2).clamp_min(0)
    return mean + var.sqrt()


def pos_pooled(kind, k):
    r = k // 2

    def keep(state):
        lo, hi, m = state.keep_first, state.num_kept - state.recent, state.num_kept
        x = kp.h2o_scores(state)[..., lo:hi]
        pos = state.positions[..., lo:hi]
        n = x.shape[-1]
        total = x.clone()
        count = torch.ones_like(x)
        best = x.clone()
        for d in range(1, r + 1):
            if d >= n:
                break
            near = (pos[..., d:] - pos[..., :-d]) <= r  # [.., n-d]: slot j and j+d within r positions
            # j gets j+d, and j+d gets j
            total[..., :-d] += torch.where(near, x[..., d:], 0.0)
            count[..., :-d] += near
            total[..., d:] += torch.where(near, x[..., :-d], 0.0)
            count[..., d:] += near
            best[..., :-d] = torch.where(near, torch.maximum(best[..., :-d], x[..., d:]), best[..., :-d])
            best[..., d:] = torch.where(near, torch.maximum(best[..., d:], x[..., :-d]), best[..., d:])
        scores = total / count if kind == "avg" else best
        dropped = lo + torch.sort(scores, dim=-1, stable=True).indices[..., : state.evict_tokens]
        kept = torch.ones(*scores.shape[:2], m, dtype=torch.bool).scatter_(-1, dropped, False)
        return torch.arange(m).expand_as(kept)[kept].view(*kept.shape[:2], m - state.evict_tokens)

    return keep


VARIANTS = {"base": None, "pavg5": pos_pooled("avg", 5), "pmax7": pos_pooled("max", 7)}
for kind in ("max", "avg"):
    for k in (3, 5, 7):
        VARIANTS[f"{kind}{k}"] = pooled(kind, k)
        VARIANTS[f"{kind}{k}all"] = pooled(kind, k, "all")

p = argparse.ArgumentParser()
p.add_argument("--text", default="wiki")
p.add_argument("--variants", default="base")
p.add_argument("--modes", default="h2o:0.2,h2o:0.5")
a = p.parse_args()
torch.set_num_threads(1)
parser = argparse.ArgumentParser()
EngineArgs.add_cli_args(parser, groups=("model",))
ea = EngineArgs.from_cli_args(parser.parse_args(["--model", "smollm2-135m", "--threads", "1"]))
model, tok = ea.load_model()
target = ea.create_target(model)
text = evaluation_text() if a.text == "wiki" else calibration_text()
ids = tokenize(tok, text)[:2048]
orig = kp.RULES["h2o"]
orig_call = kp.AttentionObserver.__call__
for v in a.variants.split(","):
    ROW["p"] = 1 if v.startswith("l1") else 2
    kp.KVState.accept, kp.KVState.evicted, kp.h2o_scores = _orig_accept, _orig_evicted, _orig_scores
    if v in ("std", "l1std"):  # l1std: VATP's l1 norm and the standard deviation together
        kp.KVState.accept, kp.KVState.evicted, kp.h2o_scores = std_accept, std_evicted, std_scores
    if v == "l1pavg5":  # VATP's l1 norm under SnapKV's position pooling
        ROW["t"] = plain
        kp.AttentionObserver.__call__ = obs_call
        kp.RULES["h2o"] = dataclasses.replace(orig, keep=VARIANTS["pavg5"])
    elif v in ROWS:
        ROW["t"] = ROWS[v]
        kp.AttentionObserver.__call__ = obs_call
        kp.RULES["h2o"] = orig
    else:
        kp.AttentionObserver.__call__ = orig_call
        kp.RULES["h2o"] = orig if VARIANTS[v] is None else dataclasses.replace(orig, keep=VARIANTS[v])
    for mode in a.modes.split(";"):
        t = time.time()
        nll, c = stream_nll(target, ids, mode, 512)
        print(f"{a.text} {v:10s} {mode:18s} {math.exp(nll / c):8.3f}  ({time.time() - t:.0f}s)", flush=True)
