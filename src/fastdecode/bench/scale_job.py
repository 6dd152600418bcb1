"""One fastdecode measurement of ``fastdecode bench-scale``, run in a process of its own.

``python -m fastdecode.bench.scale_job --model FILE ...`` loads the model as a user's program
does (``EngineArgs(...).create_engine()``: plain decoding, greedy) and prints one JSON line:

* ``load_s``: from the start of loading to the end of a first 16-token evaluation (llama.cpp's
  own "load time" counts the same span: weights mapped from the file are read on first use);
* ``prefill_tokens_per_s``: one request of ``--prompt-tokens`` tokens, prompt tokens over its time
  to first token (after a warm-up request);
* ``decode_tokens_per_s_1``: one request, ``--decode-tokens`` new tokens after the first;
* ``decode_tokens_per_s_batch``: ``--batch`` requests at once (``max_num_seqs``), the tokens
  all of them decode after each has its first token, over that time;
* each speed is the median of ``--repeats`` runs;
* ``peak_rss_bytes``: this process's VmHWM (peak resident memory) at the end.

With ``--load-only`` it stops after the load (``load_s``, ``peak_rss_bytes``). Prompts are
random token ids (a different prompt per request, and no prefix caching, so nothing is reused);
every request decodes its full budget (``min_tokens``): a random model's EOS must not cut a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

WARMUP_PROMPT_TOKENS = 16
SHORT_PROMPT_TOKENS = 16  # the decode runs' prompts (llama-bench's tg test starts from an empty context)


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """VmHWM of a process (Linux), in bytes; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, length).tolist() for _ in range(n)]  # ids 0-2: unk, bos, eos


def _batch_decode_tokens_per_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens decoded per second by all requests together once each has its first token."""
    ids = [engine.add_request(p, max_new_tokens=new_tokens, min_tokens=new_tokens) for p in prompts]
    counts = dict.fromkeys(ids, 0)
    t_all_started = None
    tokens_at_start = 0
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] += len(out.token_ids)
        if t_all_started is None and all(counts.values()):
            t_all_started, tokens_at_start = time.perf_counter(), sum(counts.values())
    elapsed = time.perf_counter() - t_all_started
    return (sum(counts.values()) - tokens_at_start) / elapsed if elapsed > 0 else 0.0


def _speeds(engine, vocab: int, args: argparse.Namespace) -> dict:
    """Prefill and decode speeds, each the median of ``args.repeats`` runs after a warm-up."""
    n = args.repeats
    long_prompts = _prompts(vocab, n + 1, args.prompt_tokens, args.seed + 1)
    engine.generate(long_prompts[0], max_new_tokens=1)  # warm-up at the prompt's length
    prefill = [engine.generate(p, max_new_tokens=1) for p in long_prompts[1:]]
    short = _prompts(vocab, 1 + n + args.batch * (n + 1), SHORT_PROMPT_TOKENS, args.seed + 2)
    engine.generate(short[0], max_new_tokens=4, min_tokens=4)  # warm-up of the decode path
    budget = args.decode_tokens + 1  # the first token comes with the prefill
    one = [engine.generate(p, max_new_tokens=budget, min_tokens=budget) for p in short[1 : n + 1]]
    batches = [short[n + 1 + i * args.batch : n + 1 + (i + 1) * args.batch] for i in range(n + 1)]
    _batch_decode_tokens_per_s(engine, batches[0], 4)  # warm-up at the batch size
    return {
        "prefill_tokens_per_s": float(np.median([r.num_prompt_tokens / r.ttft_s for r in prefill])),
        "decode_tokens_per_s_1": float(np.median([r.decode_tokens_per_s for r in one])),
        "decode_tokens_per_s_batch": float(
            np.median([_batch_decode_tokens_per_s(engine, b, budget) for b in batches[1:]])
        ),
    }


def run(args: argparse.Namespace) -> dict:
    from fastdecode.args import EngineArgs

    chosen = {"weights": args.weights} if args.weights is not None else {}  # else what a user gets by default
    engine_args = EngineArgs(
        model=args.model,
        drafter="none",
        threads=args.threads,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        **chosen,
    )
    t0 = time.perf_counter()
    engine = engine_args.create_engine()
    vocab = engine.target.vocab_size
    (warmup,) = _prompts(vocab, 1, WARMUP_PROMPT_TOKENS, args.seed)
    engine.generate(warmup, max_new_tokens=1)
    import torch

    result = {
        "load_s": time.perf_counter() - t0,
        "backend": engine.target.name,
        "weights": getattr(engine.target, "weights", engine_args.weights),
        "threads": torch.get_num_threads(),
    }
    if not args.load_only:
        result.update(_speeds(engine, vocab, args))
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdecode.bench.scale_job", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default=None, help="fastdecode's --weights (default: fastdecode's default)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="runs of each measurement, median reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-only", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
