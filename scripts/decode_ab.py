"""Decode and prefill speed of several ``--weights`` (or compressed directories) on one model,
interleaved in one process so that drift on a shared machine hits each alike.

Each round runs every configuration once: greedy decoding of ``--tokens`` new tokens from a fixed
prompt through the Engine (decode tok/s: tokens after the first over the time after the first),
and a ``--prefill``-token forward (prefill tok/s). With ``--batch N`` the decode step runs N
requests at once (the fixed prompt and the built-in suite's first N - 1 prompts; decode tok/s is
the sum of the requests' own rates, which run side by side). Prints each configuration's median
and min/max over ``--rounds`` rounds, after one warm-up round, and the median of its per-round
ratios to the first configuration (each round's pair taken minutes, not hours, apart).

    PYTHONPATH=src python scripts/decode_ab.py --configs int8,q8_0,w8a8 --rounds 7
    PYTHONPATH=src python scripts/decode_ab.py --configs int8,DIR1,DIR2   # a directory: --model DIR
    PYTHONPATH=src python scripts/decode_ab.py --configs q8_0,sparse24 --batch 8 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from fastdecode.args import EngineArgs
from fastdecode.backends.base import PagedSequence
from fastdecode.data.corpora import evaluation_text
from fastdecode.data.suite import builtin_suite
from fastdecode.decoding.logits_process import ProcessingParams
from fastdecode.engine import GenerationConfig
from fastdecode.evaluation.quality import tokenize

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def build(config: str, model_spec: str, kv_cache_dtype: str):
    options = {"kv_cache_dtype": kv_cache_dtype}
    is_dir = Path(config).is_dir()
    args = EngineArgs(model=config, **options) if is_dir else EngineArgs(model=model_spec, weights=config, **options)
    model, tokenizer = args.load_model()
    target = args.create_target(model)
    engine = args.create_engine(GenerationConfig(max_new_tokens=8), model=model, tokenizer=tokenizer, target=target)
    return engine, target, tokenizer


def decode_tps(engine, tokens: int, batch: int) -> float:
    config = GenerationConfig(max_new_tokens=tokens, processing=ProcessingParams(min_tokens=tokens))  # no early EOS
    if batch == 1:
        return engine.generate(PROMPT, config).decode_tokens_per_s
    prompts = [PROMPT, *(s.prompt for s in builtin_suite())][:batch]
    return sum(r.decode_tokens_per_s for r in engine.generate(prompts, config))


def prefill_tps(target, ids: list[int]) -> float:
    seq = PagedSequence(target)
    t = time.perf_counter()
    seq.forward(ids, 1)
    return len(ids) / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="int8,q8_0,w8a8", help="','-separated --weights names or directories")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=1, help="requests decoded at once")
    p.add_argument("--kv-cache-dtype", default="auto", help="every configuration's KV cache (as --kv-cache-dtype)")
    args = p.parse_args()
    configs = args.configs.split(",")
    built = {c: build(c, args.model, args.kv_cache_dtype) for c in configs}
    ids = tokenize(next(iter(built.values()))[2], evaluation_text())[: args.prefill]
    decode: dict[str, list[float]] = {c: [] for c in configs}
    prefill: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds + 1):
        for c in configs:
            engine, target, _ = built[c]
            d, f = decode_tps(engine, args.tokens, args.batch), prefill_tps(target, ids)
            if r:  # round 0 warms up
                decode[c].append(d)
                prefill[c].append(f)
    print(
        f"batch {args.batch}, {args.tokens} new tokens a request, {args.rounds} rounds, KV cache {args.kv_cache_dtype}"
    )
    head = f"{'config':40} {'weights':14} {'decode tok/s (median, min-max)':>32} {'vs first':>9} {'prefill tok/s':>26}"
    print(head)
    for c in configs:
        d, f = decode[c], prefill[c]
        ratio = statistics.median(x / y for x, y in zip(d, decode[configs[0]]))
        print(
            f"{c[-40:]:40} {built[c][1].weights:14} {statistics.median(d):14.1f} ({min(d):.1f}-{max(d):.1f})"
            f" {ratio:8.2f}x {statistics.median(f):14.0f} ({min(f):.0f}-{max(f):.0f})"
        )


if __name__ == "__main__":
    main()
