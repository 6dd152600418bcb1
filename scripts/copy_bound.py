"""An upper bound on copy-based drafting (n-gram, prompt lookup, suffix) for one target, from its own outputs.

Method. For each prompt, the target's plain greedy continuation O (``--weights gguf`` by default, the
native engine, 96 new tokens; cached in a JSON file) is taken as the truth. O[0] comes from the prefill;
the decode steps produce O[1:]. A step at position t (context C = prompt + O[:t]) that verifies K draft
tokens costs T(1 + K) and gains a + 1 tokens, a <= K the accepted ones (the bonus token included).
T is a cost line T(rows) = 1 + slope (rows - 1) for each ``--slopes`` value, and the pass times measured
here (``--measure``: the gguf target's own passes of 1..16 rows on one sequence, timed alternately, one
thread; the bench's own cost table is the median of the same timings). The speed-up of a prompt is
(len(O) - 1) T(1) / (its steps' T); per category and overall it is the ratio of the summed plain and
speculative costs (the bench's convention: total plain time / total speculative time); the geometric
mean and worst prompt are given beside it. Prefill is not counted but in ``overall+prefill``: the
bench's wall time counts it, so each prompt's prefill is added to both sides there, at its share of
the plain run's time (cached with the outputs: single-thread timings of one run, a rough share).

Per prompt and step t, L(t) is the most draft tokens that could be accepted:

* ``oracle-copy``: the longest L with O[t:t+L] a substring of C. Prompt lookup and suffix drafting
  propose substrings of the context (suffix: of earlier requests' tokens too, ``oracle-copy+hist``,
  which adds the earlier prompts and outputs of the run, in bench order). So no such drafter can have
  more than L(t) tokens accepted at t.
* ``oracle-bigram``: the longest L with every bigram of C[-1], O[t], .., O[t+L-1] occurring in C. The
  n-gram drafter (ANPD) chains predictions, so its draft need not be a substring of C (it splices
  pieces that share N - 1 tokens); but each token it predicts at any order n >= 2 has been seen after
  the token before it, so its accepted length is at most this L(t). It bounds n-gram drafting of any N.

Exceptions: a token tree (``--draft-tree``) verifies several paths, so it could beat one chain's bound
where paths diverge; a persistent n-gram memory (``persistent=True``, not the default) or a suffix
history across runs draws on text outside this run; none of those is in the bench configuration.

With every proposed token accepted, drafting all of L(t) minimizes the steps, and for any T with
T(1 + K) - T(1) < K T(1) it minimizes the cost under a line: greedy longest-copy parsing is optimal
because t + L(t) + 1 never decreases in t (a match's suffix is a match). ``(a)`` is that greedy
policy; ``(b)`` the best K per step by dynamic programming over the positions (equal to (a) on a
line, better on a measured table whose T is not linear in the rows). For the real drafters
(``ngram``: N=5, ``suffix``), their proposal at each t, with the true context, is replayed against O
(accepted: the common prefix, at most ``--cap`` = 2K = 14 tokens as the cost-aware engine's):
``naive`` drafts the whole proposal (rejected rows paid), ``perfect-cut`` the best K <= accepted per
step (the DP again: a planner that knew which tokens would be accepted), ``planned, known rates`` cuts
the n-gram chain where the engine's own policy would with each source's (order's) acceptance rate
known exactly beforehand (measured on the same prompts: a causal planner at its best, no guard, no
learning; what separates it from the perfect cut is where a copy ends, which no rate tells), and
``engine`` runs the real
engine (the bench's config: cost-aware K, source cuts, the guard) with its cost model replaced by the
same line, so its K choices and guard pauses are real and only the clock is modeled
(``scripts/guard_modeled.py``'s method, on the gguf target). Its tokens are checked against O.

    PYTHONPATH=src python scripts/copy_bound.py --per-category 2 --measure
    PYTHONPATH=src python scripts/copy_bound.py --all --no-engine
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastdecode.args import EngineArgs
from fastdecode.bench.datasets import DatasetOptions, load_humaneval, load_suite
from fastdecode.drafters.ngram import NGramDrafter
from fastdecode.drafters.suffix import SuffixDrafter
from fastdecode.engine import planning, policy

Cost = Callable[[int], float]
MAX_ROWS = 16


# -- the truth: plain greedy continuations ----------------------------------------------------
def samples(per_category: int | None) -> list:
    options = DatasetOptions(limit=per_category)
    return load_suite(options) + load_humaneval(options)


def engine_args(weights: str, drafter: str = "none", **extra) -> EngineArgs:
    extra = {"ngram_n": 5, **extra} if drafter == "ngram" else extra
    return EngineArgs(model="smollm2-135m", weights=weights, drafter=drafter, draft_k=7, threads=1, **extra)


def plain_outputs(path: Path, per_category: int | None, weights: str, max_new_tokens: int) -> list[dict]:
    """Each sample's prompt ids and plain greedy output, generated once and cached in ``path``."""
    cached = json.loads(path.read_text()) if path.exists() else {}
    todo = [s for s in samples(per_category) if s.sample_id not in cached]
    if todo:
        args = engine_args(weights)
        model, tokenizer = args.load_model()
        engine = args.create_engine(model=model, tokenizer=tokenizer)
        for s in todo:
            result = engine.generate(s.prompt, max_new_tokens=max_new_tokens)
            cached[s.sample_id] = {
                "category": s.category,
                "prompt_ids": engine.encode(s.prompt),
                "output_ids": list(result.token_ids),
                "ttft_s": result.ttft_s,
                "decode_s": result.wall_s - result.ttft_s,
            }
            print(f"generated {s.sample_id}: {len(result.token_ids)} tokens", flush=True)
        path.write_text(json.dumps(cached))
    return [{"sample_id": s.sample_id, **cached[s.sample_id]} for s in samples(per_category)]


def measured_costs(weights: str, repeats: int = 15, context: int = 256) -> dict[int, float]:
    """Median CPU ms of a pass of 1..MAX_ROWS rows after ``context`` tokens, on one sequence, one
    thread (CPU time: on a shared machine wall time counts the other processes' turns too), every
    row count timed once per round."""
    from fastdecode.bench.probe import one_sequence

    args = engine_args(weights)
    model, _ = args.load_model()
    _, seq = one_sequence(args.create_target(model))
    seq.reset()
    seq.forward([(100 + i) % seq.vocab_size for i in range(context)], 1)
    times: dict[int, list[float]] = {r: [] for r in range(1, MAX_ROWS + 1)}
    for round_ in range(repeats + 1):
        for rows in times:
            seq.truncate(context)
            t0 = time.process_time()
            seq.forward([(5 + i) % seq.vocab_size for i in range(rows)], rows)
            if round_:  # (round 0 warms up)
                times[rows].append(time.process_time() - t0)
    return {rows: 1000 * sorted(ts)[len(ts) // 2] for rows, ts in times.items()}


# -- what could be accepted at each step -------------------------------------------------------
def copy_lengths(prompt: Sequence[int], out: Sequence[int], history: Sequence[Sequence[int]] = ()) -> list[int]:
    """L(t) for t = 1..len(out)-1: the longest L with out[t:t+L] a substring of prompt + out[:t]
    (or of a ``history`` document).

    >>> copy_lengths([7, 1, 2, 3], [9, 1, 2, 4, 2, 4])  # t=1: "1 2" in the prompt; t=4: "2 4" at out[2:4]
    [2, 1, 0, 2, 1]
    """
    docs = [list(doc) for doc in history]
    context = list(prompt) + list(out[:1])
    indexes = [_positions(doc) for doc in (*docs, context)]  # the context's last: it grows
    lengths = []
    for t in range(1, len(out)):
        best = 0
        for doc, index in zip((*docs, context), indexes):
            for j in index.get(out[t], ()):
                n = 1
                while j + n < len(doc) and t + n < len(out) and doc[j + n] == out[t + n]:
                    n += 1
                best = max(best, n)
        lengths.append(best)
        indexes[-1].setdefault(out[t], []).append(len(context))
        context.append(out[t])
    return lengths


def _positions(tokens: Sequence[int]) -> dict[int, list[int]]:
    index: dict[int, list[int]] = {}
    for j, token in enumerate(tokens):
        index.setdefault(token, []).append(j)
    return index


def bigram_lengths(prompt: Sequence[int], out: Sequence[int]) -> list[int]:
    """L(t): the longest L with every bigram of context[-1], out[t], .., out[t+L-1] seen in the context.

    >>> bigram_lengths([1, 2, 3, 2, 4], [5, 2, 3, 9])  # at t=1 (context ends 4, 5): (5, 2) unseen
    [0, 1, 0]
    """
    seq = list(prompt) + list(out)
    pairs = set(zip(prompt, prompt[1:]))
    lengths = []
    for t in range(1, len(out)):
        pairs.add((seq[len(prompt) + t - 2], seq[len(prompt) + t - 1]))  # the context's last bigram
        n, pos = 0, len(prompt) + t
        while pos + n < len(seq) and (seq[pos + n - 1], seq[pos + n]) in pairs:
            n += 1
        lengths.append(n)
    return lengths


def replayed(drafter, prompt: Sequence[int], out: Sequence[int], cap: int) -> tuple[list[int], list[int]]:
    """(proposed, accepted) lengths at each t of a drafter that sees the true context, k = ``cap``."""
    drafter.begin(list(prompt))
    drafter.observe(list(out[:1]), 0)
    context = list(prompt) + list(out[:1])
    proposed, accepted = [], []
    for t in range(1, len(out)):
        draft = drafter.propose(context, min(cap, len(out) - 1 - t)).tokens
        a = 0
        while a < len(draft) and draft[a] == out[t + a]:
            a += 1
        proposed.append(len(draft))
        accepted.append(a)
        drafter.observe([out[t]], 0)
        context.append(out[t])
    drafter.finish()
    return proposed, accepted


# -- cost of a prompt's decode steps -------------------------------------------------------------
def greedy_cost(lengths: list[int], cost: Cost) -> float:
    """Each step drafts all of L(t) (every token accepted)."""
    total, t, n = 0.0, 0, len(lengths)
    while t < n:
        k = min(lengths[t], n - 1 - t)
        total += cost(1 + k)
        t += k + 1
    return total


def best_cost(lengths: list[int], cost: Cost) -> float:
    """The least cost over K(t) <= L(t) per step (dynamic programming over the positions)."""
    n = len(lengths)
    best = [0.0] * (n + 1)
    for t in range(n - 1, -1, -1):
        best[t] = min(cost(1 + k) + best[t + k + 1] for k in range(min(lengths[t], n - 1 - t) + 1))
    return best[0]


def naive_cost(proposed: list[int], accepted: list[int], cost: Cost) -> float:
    """Each step verifies the whole proposal and gains its accepted tokens and the bonus."""
    total, t = 0.0, 0
    while t < len(proposed):
        total += cost(1 + proposed[t])
        t += accepted[t] + 1
    return total


# -- the n-gram drafter cut by a planner that knows its sources' rates ------------------------------
def source_rates(data: list[dict], cap: int) -> dict[str, float]:
    """P(accepted | reached) of each n-gram source (order) over every replayed step of ``data``."""
    counts: dict[str, list[int]] = {}
    for d in data:
        drafter, out = NGramDrafter(n=5, k=7), d["output_ids"]
        drafter.begin(d["prompt_ids"])
        drafter.observe(out[:1], 0)
        context = list(d["prompt_ids"]) + out[:1]
        for t in range(1, len(out)):
            tokens, sources = drafter._chain(context, min(cap, len(out) - 1 - t))
            a = _accepted(tokens, out, t)
            for i, source in enumerate(sources[: a + 1]):
                c = counts.setdefault(source, [0, 0])
                c[0] += i < a
                c[1] += 1
            drafter.observe([out[t]], 0)
            context.append(out[t])
    return {source: (a + 1) / (r + 2) for source, (a, r) in counts.items()}


def _accepted(tokens: Sequence[int], out: Sequence[int], t: int) -> int:
    a = 0
    while a < len(tokens) and t + a < len(out) and tokens[a] == out[t + a]:
        a += 1
    return a


def planned_cost(d: dict, rates: dict[str, float], cost: Cost, cap: int) -> float:
    """The n-gram drafter's chain cut where the engine's policy (``BatchDraftPolicy.plan``, a request
    alone) stops expecting it to pay, from ``rates`` known beforehand; no guard, no learning."""

    class Line(policy.BatchDraftPolicy):
        def cost(self, rows: int) -> float:
            return cost(rows)

    line = Line()
    line.forward_s = {1: cost(1)}
    drafter, out = NGramDrafter(n=5, k=7), d["output_ids"]
    drafter.begin(d["prompt_ids"])
    drafter.observe(out[:1], 0)
    context = list(d["prompt_ids"]) + out[:1]
    t, total = 1, 0.0
    while t < len(out):
        tokens, sources = drafter._chain(context, min(cap, len(out) - 1 - t))
        k = line.plan(1, [([rates[s] for s in sources], len(sources))], made=True)[0] if sources else 0
        a = _accepted(tokens[:k], out, t)
        total += cost(1 + k)
        new = out[t : t + a + 1]
        drafter.observe(new, a)
        context += new
        t += a + 1
    return total


# -- the real engine on a modeled clock ----------------------------------------------------------
def engine_costs(rows_by_cost: dict[str, Cost], drafter: str, weights: str, data: list[dict]) -> dict[str, list]:
    """Per cost: each prompt's modeled cost of the engine's own passes (a fresh engine per cost, the
    prompts in bench order), its tokens checked against the plain output."""
    args = engine_args(weights, drafter, cost_aware_k=True)
    model, tokenizer = args.load_model()
    rows_log: list[int] = []
    record_pass = planning.DraftPlanner.record_pass
    original_cost = policy.BatchDraftPolicy.cost

    def logged(self, decoding, num_rows, *rest):
        rows_log.append(num_rows)
        return record_pass(self, decoding, num_rows, *rest)

    planning.DraftPlanner.record_pass = logged
    out: dict[str, list] = {}
    try:
        for name, cost in rows_by_cost.items():
            policy.BatchDraftPolicy.cost = lambda self, rows, cost=cost: cost(rows)
            engine = args.create_engine(model=model, tokenizer=tokenizer)
            out[name] = []
            for d in data:
                rows_log.clear()
                result = engine.generate(d["prompt_ids"], max_new_tokens=len(d["output_ids"]))
                if list(result.token_ids) != d["output_ids"]:
                    raise SystemExit(f"{d['sample_id']}: {drafter} output differs from plain decoding")
                a = result.acceptance
                out[name].append((sum(cost(r) for r in rows_log), a.drafted_tokens, a.accepted_tokens))
    finally:
        planning.DraftPlanner.record_pass = record_pass
        policy.BatchDraftPolicy.cost = original_cost
    return out


# -- figures ---------------------------------------------------------------------------------------
def ratios(data: list[dict], costs: list[float], cost: Cost) -> dict[str, float]:
    """Speed-up per category and overall (summed plain cost / summed cost), geometric mean, worst."""
    plain = [(len(d["output_ids"]) - 1) * cost(1) for d in data]
    out: dict[str, float] = {}
    for category in dict.fromkeys(d["category"] for d in data):
        idx = [i for i, d in enumerate(data) if d["category"] == category]
        out[category] = sum(plain[i] for i in idx) / sum(costs[i] for i in idx)
    out["overall"] = sum(plain) / sum(costs)
    # the bench's wall time counts the prefill too: each prompt's, in 1-row passes of its plain run
    prefill = [d["ttft_s"] / d["decode_s"] * (len(d["output_ids"]) - 1) * cost(1) for d in data]
    out["overall+prefill"] = (sum(plain) + sum(prefill)) / (sum(costs) + sum(prefill))
    each = [p / c for p, c in zip(plain, costs) if c > 0]
    out["geomean"] = math.exp(sum(math.log(x) for x in each) / len(each))
    out["worst"] = min(each)
    return out


def lengths_by_method(data: list[dict], cap: int) -> dict[str, list]:
    """Per method, per prompt: L(t) (or (proposed, accepted) for the replayed drafters)."""
    methods: dict[str, list] = {"oracle-copy": [], "oracle-copy+hist": [], "oracle-bigram": [], "oracle-any": []}
    methods.update({"ngram": [], "suffix": []})
    ngram, suffix = NGramDrafter(n=5, k=7), SuffixDrafter(k=7)
    history: list[list[int]] = []
    for d in data:
        prompt, out = d["prompt_ids"], d["output_ids"]
        methods["oracle-copy"].append(copy_lengths(prompt, out))
        methods["oracle-copy+hist"].append(copy_lengths(prompt, out, history[-suffix.max_cached_requests :]))
        methods["oracle-bigram"].append(bigram_lengths(prompt, out))
        methods["oracle-any"].append(
            [max(x, y) for x, y in zip(methods["oracle-copy+hist"][-1], methods["oracle-bigram"][-1])]
        )
        methods["ngram"].append(replayed(ngram, prompt, out, cap))
        methods["suffix"].append(replayed(suffix, prompt, out, cap))
        history.append(list(prompt) + list(out))
    return methods


def table(data: list[dict], methods: dict[str, list], engine: dict[str, list], cost: Cost, cap: int) -> list[str]:
    rows: list[tuple[str, list[float]]] = []
    for name in ("oracle-copy", "oracle-copy+hist", "oracle-bigram", "oracle-any"):
        rows.append((f"{name} (a) greedy", [greedy_cost(L, cost) for L in methods[name]]))
        rows.append((f"{name} (b) best K", [best_cost(L, cost) for L in methods[name]]))
    rows.append(
        (f"oracle-bigram (b), K<={cap}", [best_cost([min(x, cap) for x in L], cost) for L in methods["oracle-bigram"]])
    )
    rates = source_rates(data, cap)
    rows.append(("ngram planned, known rates", [planned_cost(d, rates, cost, cap) for d in data]))
    for name in ("ngram", "suffix"):
        rows.append((f"{name} perfect cut", [best_cost(a, cost) for _, a in methods[name]]))
        rows.append((f"{name} naive (all proposed)", [naive_cost(p, a, cost) for p, a in methods[name]]))
        if name in engine:
            rows.append((f"{name} engine (modeled clock)", [c for c, _, _ in engine[name]]))
    header = None
    lines = []
    for label, costs in rows:
        r = ratios(data, costs, cost)
        if header is None:
            header = f"| method | {' | '.join(r)} |"
            lines += [header, "|---" + "|---:" * len(r) + "|"]
        lines.append(f"| {label} | " + " | ".join(f"{x:.2f}" for x in r.values()) + " |")
    return lines


def slope_line(slope: float) -> Cost:
    return lambda rows: 1.0 + slope * (rows - 1)


def table_line(ms: dict[int, float]) -> Cost:
    top = max(ms)
    extra = (ms[top] - ms[top - 1]) / ms[1]
    return lambda rows: ms[rows] / ms[1] if rows in ms else ms[top] / ms[1] + extra * (rows - top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=2, help="prompts a category (the bench's --limit)")
    parser.add_argument("--all", action="store_true", help="every prompt of the suite and HumanEval")
    parser.add_argument("--weights", default="gguf")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--cache", type=Path, default=Path("bench-out/copy_bound_outputs.json"))
    parser.add_argument("--slopes", default="0.05,0.11,0.23,0.35,0.5")
    parser.add_argument("--measure", action="store_true", help="also the pass times measured here, one thread")
    parser.add_argument("--cap", type=int, default=14, help="the most draft tokens a step (cost-aware: 2K)")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine runs on a modeled clock")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    data = plain_outputs(args.cache, None if args.all else args.per_category, args.weights, args.max_new_tokens)
    costs: dict[str, Cost] = {f"line, slope {s}": slope_line(float(s)) for s in args.slopes.split(",")}
    if args.measure:
        ms = measured_costs(args.weights)
        print("measured pass CPU ms by rows (1 thread):", {r: round(v, 3) for r, v in ms.items()})
        costs[f"measured here (T(8)/T(1) = {ms[8] / ms[1]:.2f})"] = table_line(ms)
    methods = lengths_by_method(data, args.cap)
    engine = {} if args.no_engine else {d: engine_costs(costs, d, args.weights, data) for d in ("ngram", "suffix")}
    for name, cost in costs.items():
        print(f"\n### {len(data)} prompts, {name}\n")
        print("\n".join(table(data, methods, {d: e[name] for d, e in engine.items()}, cost, args.cap)))


if __name__ == "__main__":
    main()
