"""Token trees against chains, interleaved per prompt in one process (docs/benchmarks.md §6c).

    .venv/bin/python scripts/bench_draft_tree.py [--model smollm2-135m] [--weights gguf]
        [--configs none:1,ngram:1,ngram:3,ngram:auto,recycling:1,recycling:3,recycling:auto] [--samples 10]

Each config (drafter:draft_tree) is one engine on one shared target; the prompts are the
built-in suite's, one category after another; every output is checked against plain
decoding's. Prints tok/s (new tokens / wall time, warm-up excluded), the ratio to plain,
tau, and the rows per verification pass, with what the same paths would cost as separate
rows (a prefix shared with an earlier path counted again)."""

from __future__ import annotations

import argparse
import collections
import time

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target
from fastdecode.bench.report import machine_description
from fastdecode.data.suite import builtin_suite
from fastdecode.loading import load_model


def main() -> None:  # noqa: PLR0915 (one benchmark, read top to bottom)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--kv-cache-dtype", default=None, help="default: float16 for block weights, else the model's")
    p.add_argument("--configs", default="none:1,ngram:1,ngram:3,ngram:auto,recycling:1,recycling:3,recycling:auto")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument(
        "--cost-aware-k", action="store_true", help="draft lengths from the cost model (GenerationConfig.cost_aware_k)"
    )
    args = p.parse_args()
    model, tokenizer = load_model(args.model)
    kv = args.kv_cache_dtype or ("auto" if args.weights in ("float", "int8", "int4") else "float16")
    target = make_target(model, "native", args.weights, kv_cache_dtype=kv)
    by_category = collections.defaultdict(list)
    for sample in builtin_suite():
        by_category[sample.category].append(sample)
    categories = list(by_category)
    samples = [by_category[categories[i % len(categories)]][i // len(categories)] for i in range(args.samples)]
    configs = [
        (name, "auto" if tree == "auto" else int(tree))
        for name, tree in (c.split(":") for c in args.configs.split(","))
    ]
    engines = {
        c: Engine(
            model, tokenizer, drafter=None if c[0] == "none" else build_drafter(c[0]), target=target, max_num_seqs=1
        )
        for c in configs
    }
    passes: list[tuple[int, int]] = []
    forward_batch = target.forward_batch

    def counted(cache, entries):
        passes.append((sum(len(e.token_ids) for e in entries), sum(len(e.token_ids) + len(e.shared) for e in entries)))
        return forward_batch(cache, entries)

    target.forward_batch = counted  # (an instance attribute: this process's target only)
    for (_name, tree), engine in engines.items():  # warm-up
        engine.generate(samples[0].prompt, max_new_tokens=16, draft_tree=tree, cost_aware_k=args.cost_aware_k)
    totals = {c: collections.Counter() for c in configs}
    for sample in samples:
        plain = None
        for c, engine in engines.items():
            passes.clear()
            t0 = time.perf_counter()
            result = engine.generate(
                sample.prompt,
                max_new_tokens=args.max_new_tokens,
                draft_tree=c[1],
                cost_aware_k=args.cost_aware_k and c[0] != "none",
            )
            wall = time.perf_counter() - t0
            if c[0] == "none":
                plain = result.token_ids
            elif plain is not None and result.token_ids != plain:
                raise SystemExit(f"{c}: output differs from plain decoding on {sample.prompt[:40]!r}")
            t = totals[c]
            t["wall_us"] += int(wall * 1e6)
            t["tokens"] += len(result.token_ids)
            if result.acceptance is not None:
                t["steps"] += result.acceptance.steps
                t["step_tokens"] += result.acceptance.step_tokens
            t["passes"] += len(passes) - 1  # (the prefill's pass left out)
            t["rows"] += sum(r for r, _ in passes[1:])
            t["path_rows"] += sum(r for _, r in passes[1:])
    info = machine_description()
    print(
        f"{args.model} weights={args.weights} kv={kv} samples={len(samples)} new={args.max_new_tokens} "
        f"cost_aware_k={args.cost_aware_k} cpu={info['cpu']}"
    )
    base = totals[configs[0]]
    base_rate = base["tokens"] / base["wall_us"]
    print("| drafter | paths | tok/s | vs " + f"{configs[0][0]} | tau | rows a pass | as separate paths |")
    print("|:---|---:|---:|---:|---:|---:|---:|")
    for (name, tree), t in totals.items():
        rate = t["tokens"] / t["wall_us"]
        tau = t["step_tokens"] / t["steps"] if t["steps"] else 1.0
        n = max(1, t["passes"])
        print(
            f"| {name} | {tree} | {rate * 1e6:.1f} | {rate / base_rate:.2f}x | {tau:.2f} | {t['rows'] / n:.2f} | {t['path_rows'] / n:.2f} |"
        )


if __name__ == "__main__":
    main()
