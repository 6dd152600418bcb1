"""The pruning table of docs/benchmarks.md: method x pattern x precision, scored, timed and
tried as a drafter, in one run.

For each configuration the model is pruned (``fastdecode compress``'s path: magnitude, Wanda or
SparseGPT at 50% unstructured, 2:4 or 4:8; float, or 2:4 then q8_0, run on the dense q8_0 kernel
and on the 2:4 sparse one) and saved, then:

* quality: ``fastdecode.evaluation.evaluate`` against the float model on the first ``--windows``
  windows of WikiText-2 raw test: perplexity, top-1 agreement, KL, weight MB, decode tok/s;
* batch decode: ``--batch`` prompts of the built-in suite decoded together (greedy,
  ``--new-tokens`` each, after a warm-up), total new tokens / wall time;
* as a drafter of the dense float target (``--draft-model DIR``, ``--draft-quant`` sparse24 for the
  sparse rows; K = ``--k``): acceptance (accepted / drafted) and speed-up (the plain target's wall
  time over the speculative one's, the same prompts, greedy, one request at a time).

Calibration: ``--calib-sequences`` windows of ``--calib-len`` tokens of the shipped Tiny Shakespeare
text (the papers: 128 x 2048 of C4). Prints a markdown table, writes ``--out``/results.jsonl and
report.md. The embedded model:

    .venv/bin/python scripts/pruning_table.py --windows 2 --out docs/bench/pruning
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fastdecode.args import EngineArgs
from fastdecode.data.suite import builtin_suite
from fastdecode.evaluation.quality import EvalOptions, evaluate
from fastdecode.loading import load_model
from fastdecode.quant.api import config_from_method, quantize_
from fastdecode.quant.pruning import zero_fraction
from fastdecode.quant.serialization import save_float, save_quantized

METHODS = ("magnitude", "wanda", "sparsegpt")
SHAPES = {"50%": {"sparsity": 0.5}, "2:4": {"pattern": "2:4"}, "4:8": {"pattern": "4:8"}}


def configs() -> list[dict]:
    """Each row: name, the compression (method and settings, or None: the model as it is),
    the target's --weights, and the drafter's --draft-quant."""
    rows = [
        dict(name="dense float", method=None, settings={}, weights="float", draft_quant=None),
        dict(name="dense q8_0", method=None, settings={}, weights="q8_0", draft_quant="q8_0"),
    ]
    for method in METHODS:
        for shape, settings in SHAPES.items():
            rows.append(dict(name=f"{method} {shape} float", method=method, settings=settings, weights="float"))
        q8 = {"pattern": "2:4", "then": "q8_0"}
        rows.append(dict(name=f"{method} 2:4 q8_0", method=method, settings=q8, weights="q8_0"))
        rows.append(dict(name=f"{method} 2:4 sparse24", method=method, settings=q8, weights="sparse24"))
    for row in rows:
        row.setdefault("draft_quant", "sparse24" if row["weights"] == "sparse24" else "none")
    return rows


def compressed(base: str, row: dict, args, cache: dict) -> tuple[str, float | None, float | None]:
    """(the model spec the row runs, seconds compressing, fraction of decoder weights 0); one
    compression per (method, settings), shared by the rows that run it at different --weights."""
    if row["method"] is None:
        return base, None, None
    key = (row["method"], tuple(sorted(row["settings"].items())))
    out = Path(args.work) / "-".join([row["method"], *(str(v).replace(":", "_") for _, v in key[1])])
    meta = out / "pruning_table.json"  # what a later --reuse run reads instead of compressing again
    if key not in cache and args.reuse and (out / "config.json").is_file():
        if not meta.is_file():  # compressed before the script kept its figures: count the zeros again
            model, _ = load_model(str(out), dtype="float32", device="cpu")
            meta.write_text(json.dumps({"compress_s": None, "zero_fraction": zero_fraction(model)}))
        done = json.loads(meta.read_text())
        cache[key] = (str(out), done["compress_s"], done["zero_fraction"])
    if key not in cache:
        model, tokenizer = load_model(base, dtype="float32", device="cpu", lazy=False)  # compressed from float
        settings = dict(row["settings"])
        if row["method"] != "magnitude":
            settings.update(num_sequences=args.calib_sequences, seq_len=args.calib_len)
        config = config_from_method(row["method"], **settings)
        t = time.perf_counter()
        quantize_(model, config, tokenizer=tokenizer)
        seconds = time.perf_counter() - t
        save = save_float if config.format == "float" else save_quantized
        save(model, tokenizer, out, config)
        cache[key] = (str(out), seconds, zero_fraction(model))
        meta.write_text(json.dumps({"compress_s": seconds, "zero_fraction": cache[key][2]}))
    return cache[key]


def batch_tokens_per_s(engine_args: EngineArgs, loaded, prompts: list[str], new_tokens: int) -> float:
    model, tokenizer, target = loaded
    engine = engine_args.create_engine(model=model, tokenizer=tokenizer, target=target)
    engine.generate(prompts[:1], max_new_tokens=4, temperature=0.0)  # warm-up
    t = time.perf_counter()
    results = engine.generate(prompts, max_new_tokens=new_tokens, temperature=0.0)
    return sum(r.num_new_tokens for r in results) / (time.perf_counter() - t)


def drafting(base: str, spec: str, draft_quant: str | None, prompts: list[str], args) -> dict:
    """Acceptance and speed-up of the row's model drafting for the dense float target; the plain
    target is timed right before the speculative run, so drift on a shared host hits both alike."""
    if draft_quant is None:
        return {"acceptance": None, "speedup": None}
    plain_seconds = _timed(EngineArgs(model=base), prompts, args.new_tokens)[0]
    draft_model = None if spec == base else spec
    spec_args = EngineArgs(model=base, drafter="draft-model", draft_model=draft_model, draft_quant=draft_quant)
    seconds, results = _timed(spec_args, prompts, args.new_tokens, k=args.k)
    drafted = sum(r.acceptance.drafted_tokens for r in results)
    accepted = sum(r.acceptance.accepted_tokens for r in results)
    return {"acceptance": accepted / max(drafted, 1), "speedup": plain_seconds / seconds}


def _timed(engine_args: EngineArgs, prompts: list[str], new_tokens: int, k: int | None = None):
    engine = engine_args.create_engine()
    options = {"max_new_tokens": new_tokens, "temperature": 0.0, **({"draft_k": k} if k else {})}
    engine.generate(prompts[0], **{**options, "max_new_tokens": 4})  # warm-up
    t = time.perf_counter()
    results = [engine.generate(p, **options) for p in prompts]
    return time.perf_counter() - t, results


def run_row(row: dict, args, prompts: list[str], cache: dict) -> dict:
    spec, compress_s, zeros = compressed(args.model, row, args, cache)
    engine_args = EngineArgs(model=spec, weights=row["weights"])
    model, tokenizer = engine_args.load_model()
    target = engine_args.create_target(model)
    opts = EvalOptions(
        max_windows=args.windows, window_tokens=args.window, reference=args.model, decode_tokens=args.decode_tokens
    )
    report = evaluate(engine_args, opts, loaded=(model, tokenizer, target))
    out = {"config": row["name"], **report.to_dict(), "compress_s": compress_s, "zero_fraction": zeros}
    out["batch_tokens_per_s"] = batch_tokens_per_s(engine_args, (model, tokenizer, target), prompts, args.new_tokens)
    del model, target
    out.update(drafting(args.model, spec, row["draft_quant"], prompts[: args.draft_prompts], args))
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    header = (
        "| config | numeric model | zeros | perplexity | top-1 agreement | KL | weights MB | decode tok/s | "
        "batch tok/s | acceptance as drafter | speed-up as drafter |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['weights']} | {_fmt(r['zero_fraction'], '.0%')} | {r['perplexity']:.3f} | "
            f"{_fmt(r['top1_agreement'], '.3f')} | {_fmt(r['kl'], '.4f')} | {r['weight_bytes'] / 1e6:.1f} | "
            f"{_fmt(r['decode_tokens_per_s'], '.1f')} | {r['batch_tokens_per_s']:.1f} | "
            f"{_fmt(r['acceptance'], '.2f')} | {_fmt(r['speedup'], '.2f')}x |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=2, help="WikiText-2 windows scored")
    p.add_argument("--window", type=int, default=None, help="tokens a window (default 2048 or the context)")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens of evaluate's decode-speed run")
    p.add_argument("--batch", type=int, default=8, help="prompts decoded together for batch tok/s")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens a prompt (batch and drafter runs)")
    p.add_argument("--draft-prompts", type=int, default=4, help="prompts of the drafter run")
    p.add_argument("--k", type=int, default=4, help="draft length K")
    p.add_argument("--prompt-chars", type=int, default=None, help="cut each prompt to this many characters")
    p.add_argument("--calib-sequences", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--only", default="", help="comma list of config names (default: all)")
    p.add_argument("--out", default="docs/bench/pruning")
    p.add_argument("--work", default="/tmp/fastdecode-pruning")
    p.add_argument("--reuse", action="store_true", help="take a compressed model already under --work")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    prompts = [s.prompt[: args.prompt_chars] for s in builtin_suite()][: args.batch]
    rows, cache = [], {}
    (out / "results.jsonl").write_text("")
    for row in configs():
        if args.only and row["name"] not in args.only.split(","):
            continue
        rows.append(run_row(row, args, prompts, cache))
        with open(out / "results.jsonl", "a") as f:  # row by row: a run cut short keeps what it measured
            f.write(json.dumps(rows[-1]) + "\n")
        print(json.dumps({k: rows[-1][k] for k in ("config", "weights", "perplexity", "kl", "speedup")}), flush=True)
    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    first = rows[0] if rows else {}
    text = (
        f"{args.model}, native backend, {machine}; WikiText-2 raw test, first {args.windows} window(s) of "
        f"{first.get('window_tokens')} tokens; agreement and KL against the float model; calibration "
        f"{args.calib_sequences} x {args.calib_len} tokens of Tiny Shakespeare; drafters for the dense float "
        f"target, K={args.k}, {args.draft_prompts} prompts x {args.new_tokens} tokens, greedy.\n\n" + table(rows) + "\n"
    )
    print(text)
    (out / "report.md").write_text(text)


if __name__ == "__main__":
    main()
