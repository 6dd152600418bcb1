"""The quality table of docs/benchmarks.md: each compression of the embedded model, scored
and timed in one run.

For each configuration: the model compressed in memory and saved (``fastdecode compress``'s
path) or run with ``--weights`` on the fly, then ``fastdecode.evaluation.evaluate`` against
the float32 model on the first ``--windows`` windows of 2,048 tokens of WikiText-2 raw
test (perplexity, top-1 agreement, KL, weight MB, decode tok/s), and a 512-token prefill
timed on the target (best of three after a warm-up). Prints a markdown table and writes
``--out``/results.jsonl and report.md.

    .venv/bin/python scripts/quality_table.py --windows 2 --out docs/bench/quality
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fastdecode.args import EngineArgs
from fastdecode.backends.base import PagedSequence
from fastdecode.data.corpora import evaluation_text
from fastdecode.evaluation.quality import EvalOptions, evaluate, tokenize
from fastdecode.loading import load_model
from fastdecode.quant.api import config_from_method, quantize_
from fastdecode.quant.serialization import save_quantized

# (name, --weights on the fly or None, compression method or None, its settings). Calibration:
# 8 windows of 512 tokens of the shipped calibration text, AWQ's grids at 10 (not the defaults
# 16 and 20): a 2-core CPU's budget.
CONFIGS = [
    ("float32", "float", None, {}),
    ("int8 RTN (torch weights)", "int8", None, {}),
    ("q8_0 RTN", "q8_0", None, {}),
    ("w8a8 RTN", "w8a8", None, {}),
    ("SmoothQuant W8A8 (q8_0)", None, "smoothquant", {"alpha": 0.5, "num_sequences": 8, "format": "q8_0"}),
    ("SmoothQuant W8A8 (w8a8)", None, "smoothquant", {"alpha": 0.5, "num_sequences": 8}),
    ("q8_0 RTN, LM head float", None, "q8_0", {}),
    ("w8a8 RTN, LM head float", None, "w8a8", {}),
    (
        "SmoothQuant W8A8 + LM head",
        None,
        "smoothquant",
        {"alpha": 0.5, "num_sequences": 8, "format": "q8_0", "include_lm_head": True},
    ),
    (
        "SmoothQuant W8A8 (w8a8) + LM head",
        None,
        "smoothquant",
        {"alpha": 0.5, "num_sequences": 8, "include_lm_head": True},
    ),
    ("q4_0 RTN", "q4_0", None, {}),
    ("q4_0 RTN, LM head float", None, "q4_0", {}),
    ("AWQ q4_0", None, "awq", {"group_size": 32, "format": "q4_0", "grid": 10, "clip_grid": 10, "num_sequences": 8}),
    ("q4_1 RTN", "q4_1", None, {}),
    ("gguf (the file's own blocks)", "gguf", None, {}),
]


def prefill_tokens_per_s(target, ids: list[int], n: int = 512) -> float:
    seq = PagedSequence(target)
    seq.forward(ids[:n], 1)  # warm-up
    best = float("inf")
    for _ in range(3):
        seq.reset()
        t = time.perf_counter()
        seq.forward(ids[:n], 1)
        best = min(best, time.perf_counter() - t)
    return n / best


def compressed_dir(method: str, settings: dict, work: Path) -> tuple[str, float]:
    model, tokenizer = load_model("smollm2-135m", dtype="float32", device="cpu", lazy=False)  # compressed from float
    settings = dict(settings)
    group_size = settings.pop("group_size", None)
    head = settings.pop("include_lm_head", False)
    t = time.perf_counter()
    config = config_from_method(method, group_size=group_size, **settings)
    quantize_(model, config, tokenizer=tokenizer, skip=() if head else ("lm_head",))
    seconds = time.perf_counter() - t
    out = work / f"{method}-{settings.get('format', 'default')}-{len(settings)}{'-head' if head else ''}"
    save_quantized(model, tokenizer, out, config)
    return str(out), seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--out", default="docs/bench/quality")
    p.add_argument("--work", default="/tmp/fastdecode-quality")
    p.add_argument("--only", default="", help="comma list of config names to run (default: all)")
    args = p.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    opts = EvalOptions(max_windows=args.windows, reference="smollm2-135m", decode_tokens=64)
    for name, weights, method, settings in CONFIGS:
        if args.only and name not in args.only.split(","):
            continue
        compress_s = None
        if method is None:
            engine_args = EngineArgs(model="smollm2-135m", weights=weights)
        else:
            spec, compress_s = compressed_dir(method, settings, work)
            engine_args = EngineArgs(model=spec)
        model, tokenizer = engine_args.load_model()
        target = engine_args.create_target(model)
        report = evaluate(engine_args, opts, loaded=(model, tokenizer, target))
        ids = tokenize(tokenizer, evaluation_text())
        row = {
            "config": name,
            **report.to_dict(),
            "prefill_tokens_per_s": prefill_tokens_per_s(target, ids),
            "compress_s": compress_s,
        }
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("config", "weights", "perplexity", "top1_agreement", "kl")}), flush=True)
        del model, target
    header = "| config | numeric model | perplexity | top-1 agreement | KL (nats/token) | weights MB | decode tok/s | prefill tok/s (512) | compress s |"
    lines = [header, "|" + "---|" * 9]
    for r in rows:
        agree = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.3f}"
        kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
        comp = "-" if r["compress_s"] is None else f"{r['compress_s']:.0f}"
        lines.append(
            f"| {r['config']} | {r['weights']} | {r['perplexity']:.3f} | {agree} | {kl} | "
            f"{r['weight_bytes'] / 1e6:.1f} | {r['decode_tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.0f} | {comp} |"
        )
    first = rows[0] if rows else {}
    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    text = (
        f"SmolLM2-135M-Instruct, native backend, {machine}; WikiText-2 raw test, first {args.windows} "
        f"window(s) of {first.get('window_tokens')} tokens ({first.get('num_tokens')} predicted tokens), "
        "non-overlapping; agreement and KL against float32 on the same windows.\n\n" + "\n".join(lines) + "\n"
    )
    print(text)
    (out / "report.md").write_text(text)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
