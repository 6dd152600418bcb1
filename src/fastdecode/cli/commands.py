"""The ``fastdecode`` command line: generate, demo (and more as they land).

Every error a user can cause is a FastDecodeError: printed as one line on
stderr with exit status 1, never a traceback; usage errors too (``fastdecode.util.commands.ArgumentParser``).
Ctrl-C prints one line and exits 130, and output directories appear only complete
(``fastdecode.util.files.staged_dir``). A value beyond what can take effect is brought within it with a
``fastdecode: note:`` line on stderr saying so (``EngineArgs.clamped``, ``--max-new-tokens``).
"""

from __future__ import annotations

import argparse
import json
import sys

from fastdecode.args import MODEL_OPTIONS, EngineArgs, kernel_notes
from fastdecode.cli.decoding import add_decoding_args, decoding_options, logprobs_lines
from fastdecode.errors import ConfigError
from fastdecode.loaders.gguf_model import materialize
from fastdecode.util.commands import ArgumentParser, bounded, positive_int, print_notes, run_main
from fastdecode.util.files import check_output_dir, check_utf8, read_text, text_file


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return check_utf8(args.prompt, "--prompt")
    if args.prompt_file is not None:
        return read_text(args.prompt_file, "prompt file")
    if not sys.stdin.isatty():
        return read_text(None, "prompt")
    raise ConfigError("no prompt: give --prompt, --prompt-file, or pipe text on stdin")


# Per-request keys a --prompts-file line may carry besides "prompt" (and "id", echoed back).
_PROMPT_LINE_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "speculate", "kv_policy")


def _read_prompts_file(path: str) -> list[dict]:
    """One JSON object per line: {"prompt": str, optional "id" and per-request options}."""
    text = read_text(path, "prompts file")
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ConfigError(f'{path}:{number}: expected a JSON object with a non-empty string "prompt"')
        unknown = set(item) - {"prompt", "id", *_PROMPT_LINE_OPTIONS}
        if unknown:
            raise ConfigError(
                f"{path}:{number}: unknown key(s) {', '.join(sorted(unknown))} "
                f"(allowed: prompt, id, {', '.join(_PROMPT_LINE_OPTIONS)})"
            )
        stop = item.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f'{path}:{number}: "stop" must be a string or a list of strings')
        for value in (item["prompt"], *stop):
            check_utf8(value, f"{path}:{number}")
        lines.append(item)
    if not lines:
        raise ConfigError(f"{path}: no prompts (one JSON object per line)")
    return lines


def _run_prompts_file(args: argparse.Namespace, engine) -> int:
    """Every line of the prompts file as one request, decoded together by continuous batching;
    one JSON result per line on stdout, in input order, each written as soon as it and all
    lines before it are done."""
    items = args.prompts
    specs = []
    for item in items:
        options = {k: v for k, v in item.items() if k in _PROMPT_LINE_OPTIONS}
        if isinstance(options.get("stop"), list):
            options["stop"] = tuple(options["stop"])
        specs.append(dict(prompt=item["prompt"], chat=False if args.no_chat else None, **options))
    # (every line checked before any is queued; the error names its line)
    ids = engine.add_requests(specs, names=[f"{args.prompts_file}:{number}" for number in range(1, len(items) + 1)])
    done: dict[str, object] = {}
    position = set(ids)
    next_out = 0
    while next_out < len(ids):
        for out in engine.step():
            if out.finished and out.request_id in position:
                done[out.request_id] = out.result
        while next_out < len(ids) and ids[next_out] in done:
            item, result = items[next_out], done.pop(ids[next_out])
            record = {"index": next_out, **({"id": item["id"]} if "id" in item else {}), **result.to_dict()}
            print(json.dumps(record), flush=True)
            next_out += 1
    return 0


def _run_batch(args: argparse.Namespace, engine_args: EngineArgs, config) -> int:
    """The prompts file as a resumable Ray Data job (fastdecode.scaleout.batch); a summary on stderr."""
    from fastdecode.scaleout.ray_util import import_ray

    import_ray("generate --ray")
    from fastdecode.scaleout.batch import run_batch

    ran = run_batch(
        args.prompts,
        args.out,
        engine_args,
        config,
        workers=args.workers,
        worker_cpus=args.worker_cpus,
        batch_size=args.batch_size,
        chat=False if args.no_chat else None,
        option_keys=_PROMPT_LINE_OPTIONS,
        source=args.prompts_file,
        ray_address=args.ray_address,
    )
    print(f"[{ran} prompts run, {len(args.prompts) - ran} already in {args.out}; {args.out} complete]", file=sys.stderr)
    return 0


def _max_new_tokens_notes(max_new_tokens: int, engine) -> list[str]:
    """A note when ``--max-new-tokens`` is more than the model's context can ever hold (the full
    KV cache stops there; a KV policy generates past it)."""
    context = engine.target.context_length
    if max_new_tokens < context or not engine.config.kv_policy.is_full:
        return []
    return [
        f"--max-new-tokens {max_new_tokens}: the model's context is {context} tokens, so generation stops there "
        f"(at most {context - 1} new tokens, fewer after a longer prompt)"
    ]


def cmd_generate(args: argparse.Namespace) -> int:
    from fastdecode.decoding.sampling import SamplingParams
    from fastdecode.scaleout.options import wants_batch

    batch = wants_batch(args)
    if args.prompts_file is not None:
        if args.stream:
            raise ConfigError("--stream prints one prompt's text as it is decoded; --prompts-file prints JSON lines")
        args.prompts = _read_prompts_file(args.prompts_file)
    else:
        prompt = _read_prompt(args)
        if not prompt:
            raise ConfigError("the prompt is empty")
    for stop in args.stop or ():
        check_utf8(stop, "--stop")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    engine_args, notes = EngineArgs.from_cli_args(args).clamped()
    print_notes(notes)
    config = engine_args.generation_config(
        max_new_tokens=args.max_new_tokens, sampling=sampling, stop=tuple(args.stop or ()), **decoding_options(args)
    )
    if batch:
        return _run_batch(args, engine_args, config)
    engine = engine_args.create_engine(config)
    # a prompts file's lines may set their own max_new_tokens: the note is for one prompt's run
    length_notes = [] if args.prompts_file is not None else _max_new_tokens_notes(args.max_new_tokens, engine)
    print_notes([*kernel_notes(engine), *length_notes])
    if args.prompts_file is not None:
        return _run_prompts_file(args, engine)
    stream = engine.stream(prompt, chat=False if args.no_chat else None)
    for step in stream:
        if args.stream:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    result = stream.result
    if args.json:
        out = result.to_dict()
        out.update(
            model=engine_args.model,
            backend=engine.target.name,
            weights=engine.target.weights,
            float_kernel=engine.target.float_kernel,
            dtype=engine_args.dtype,
            device=str(engine.target.device),
            kv_cache_dtype=getattr(engine.target, "kv_cache_dtype", engine_args.dtype),
        )
        print(json.dumps(out))
        return 0
    if args.stream:
        sys.stdout.write("\n")
    else:
        print(result.text)
    summary = (
        f"[{result.num_new_tokens} tokens, {result.decode_tokens_per_s:.1f} tok/s decode, ttft {result.ttft_s * 1000:.0f} ms, "
        f"finish {result.finish_reason}, weights {engine.target.weights}, drafter {result.drafter}"
    )
    if result.acceptance is not None:
        a = result.acceptance
        summary += f", alpha {a.alpha:.2f}, tau {a.tau:.2f}"
    for line in logprobs_lines(result):
        print(line, file=sys.stderr)
    print(summary + "]", file=sys.stderr)
    return 0


def _eval_options(args: argparse.Namespace, **overrides):
    from fastdecode.evaluation.quality import EvalOptions

    values = dict(
        text=args.text and args.text.text,
        text_name=args.text and args.text.path,
        window_tokens=args.window,
        stride_tokens=args.stride,
        max_windows=getattr(args, "max_windows", None),
    )
    return EvalOptions(**{**values, **overrides})


def _progress(what: str):
    """A progress callback writing ``what: window i/n`` on stderr when it is a terminal (else None)."""
    if not sys.stderr.isatty():
        return None

    def report(done: int, total: int) -> None:
        sys.stderr.write(f"\r{what}: window {done}/{total}" + ("\n" if done == total else ""))
        sys.stderr.flush()

    return report


def cmd_eval(args: argparse.Namespace) -> int:
    from fastdecode.evaluation.quality import evaluate

    options = _eval_options(
        args,
        reference=args.reference,
        compare=not args.no_reference,
        decode_tokens=args.decode_tokens,
    )
    report = evaluate(EngineArgs.from_cli_args(args), options, progress=_progress("eval"))
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(report.lines()))
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    from fastdecode.evaluation.quality import evaluate
    from fastdecode.formats import compress_lm_head
    from fastdecode.loading import load_model
    from fastdecode.quant.api import config_from_method, model_weight_bytes, quantize_
    from fastdecode.quant.pruning import PruneConfig, zero_fraction
    from fastdecode.quant.serialization import save_float, save_quantized

    names = ("bits", "format", "alpha", "sparsity", "pattern", "then")
    settings = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    config = config_from_method(args.method, group_size=args.group_size, **settings)
    layers_format = getattr(config, "format", None) or config.method
    if args.save_format == "compressed-tensors" and layers_format not in ("q4_0", "q8_0", "int8", "w8a8"):
        # refused before the (possibly long) calibration, not after it
        raise ConfigError(
            f"--save-format compressed-tensors: {args.method} makes {layers_format} layers, which have no exact "
            "compressed-tensors form (q4_0, q8_0, int8 and w8a8 do)"
        )
    check_output_dir(args.out, "quantized model")
    model, tokenizer = load_model(args.model, dtype="float32", device="cpu", trust_remote_code=args.trust_remote_code)
    materialize(model)  # compression starts from the float weights
    before = model_weight_bytes(model)
    # the head's default is the quantizing method's: --then's after pruning (--method wanda --then smoothquant)
    quantizer = args.then or args.method
    head = compress_lm_head(quantizer) if args.include_lm_head is None else args.include_lm_head
    quantize_(model, config, tokenizer=tokenizer, skip=() if head else ("lm_head",))
    after = model_weight_bytes(model)
    if getattr(config, "format", None) == "float":  # pruned, not quantized: a plain model directory
        out = save_float(model, tokenizer, args.out, config)
    else:
        out = save_quantized(model, tokenizer, args.out, config, format=args.save_format)
    print(f"{args.model} -> {out} ({args.method}): weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB", flush=True)
    if isinstance(config, PruneConfig):
        print(f"{config.describe()}: {zero_fraction(model):.1%} of the decoder layers' weights are 0", flush=True)
        if config.pattern == (2, 4) and config.format == "float":
            print(f"on the 2:4 sparse float32 kernel (these weights exactly): --model {out} --weights sparse24-f32")
        if config.pattern == (2, 4) and config.format in ("float", "q8_0"):
            print(f"on the 2:4 sparse q8_0 kernel: --model {out} --weights sparse24", flush=True)
    if args.eval_windows == 0:
        return 0
    del model
    options = _eval_options(args, max_windows=args.eval_windows, reference=args.model, decode_tokens=16)
    saved = EngineArgs(model=str(out), trust_remote_code=args.trust_remote_code)
    r = evaluate(saved, options, progress=_progress("quality"))
    text = f"the built-in text, {r.text}," if args.text is None else args.text.path
    where = f"{text} ({r.num_windows} window(s) of {r.window_tokens} tokens)"
    if r.reference_perplexity is None:  # the source was itself a compressed model: no float reference
        print(f"perplexity on {where}: {r.perplexity:.3f}")
    else:
        print(f"perplexity on {where}: float {r.reference_perplexity:.3f} -> {r.perplexity:.3f}")
        print(f"top-1 agreement {r.top1_agreement:.4f}, KL {r.kl:.4g} nats/token against the float model")
    speed = "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.1f}"
    print(f"runs as {r.weights} on {r.backend}: {r.weight_bytes / 1e6:.1f} MB of weights a token, decode {speed} tok/s")
    print_notes(r.notes)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from fastdecode.cli.demo import demo

    engine_args, notes = EngineArgs.from_cli_args(args).clamped()
    print_notes(notes)
    return demo(engine_args, max_new_tokens=args.max_new_tokens)


def _add_text_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--text",
        type=text_file,
        default=None,
        metavar="FILE",
        help="score this UTF-8 text instead of the built-in one (the WikiText-2 raw test split)",
    )
    p.add_argument(
        "--window",
        type=bounded(int, "an integer >= 2", low=2),
        default=None,
        help="tokens per window, each scored alone on a fresh cache (default: 2048, or the context length if shorter)",
    )
    p.add_argument(
        "--stride",
        type=positive_int,
        default=None,
        help="tokens between window starts (default: the window: non-overlapping, as the GPTQ/Wanda papers)",
    )


def _add_eval_parser(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="quality of a model as fastdecode runs it: perplexity, top-1 agreement and KL vs float, MB, tok/s",
        description="Perplexity by the GPTQ/SparseGPT/Wanda convention (the text tokenized once, non-overlapping "
        "windows of 2048 tokens each scored alone), top-1 agreement and mean KL(float || this) against the float "
        "model on the same windows, the weights' bytes and greedy decode tokens/s.",
    )
    e.add_argument("model", help="built-in name, .gguf file, model directory (a compressed one too) or hub id")
    EngineArgs.add_cli_args(e, only=tuple(n for n in MODEL_OPTIONS if n != "model"))
    _add_text_args(e)
    e.add_argument(
        "--max-windows", type=positive_int, default=None, metavar="N", help="score at most N windows (default: all)"
    )
    e.add_argument(
        "--reference",
        default=None,
        metavar="MODEL",
        help="the float model to compare with (default: MODEL itself, in float32 with float weights)",
    )
    e.add_argument("--no-reference", action="store_true", help="perplexity only: no float reference model")
    e.add_argument(
        "--decode-tokens",
        type=bounded(int, "an integer >= 0", low=0),
        default=32,
        metavar="N",
        help="new tokens of the greedy decode-speed run, after a warm-up (0: skip; default: %(default)s)",
    )
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval)


def _add_compress_parser(sub, methods: tuple[str, ...]) -> None:
    q = sub.add_parser(
        "compress",
        aliases=["quantize"],
        help="compress a model's linear weights, save it (load it back with --model DIR), report its quality",
    )
    q.add_argument("model", help="built-in name, .gguf file, model directory or hub id")
    q.add_argument(
        "--method",
        required=True,
        choices=list(methods),
        help="int8/int4 (RTN) and int4-gptq: torch's packed kernels; q8_0/q4_0/q4_1: GGUF's block formats, "
        "run as --weights q8_0|q4_0|q4_1 runs them (native backend); magnitude/wanda/sparsegpt: pruning "
        "(--sparsity or --pattern, --then)",
    )
    q.add_argument("--group-size", type=positive_int, default=None, help="int4 group size (32, 64, 128; default 32)")
    q.add_argument("--bits", type=positive_int, default=None, help="weight bits, for methods that take them (awq)")
    q.add_argument("--format", default=None, help="the output weight format, for methods that choose one (awq)")
    q.add_argument(
        "--alpha",
        type=bounded(float, "a number in [0, 1]", low=0.0, high=1.0),
        default=None,
        help="migration strength, for smoothquant (default: the method's, 0.5)",
    )
    q.add_argument(
        "--sparsity",
        type=bounded(float, "a number in [0, 1)", low=0.0, high=0.999),
        default=None,
        help="fraction of weights pruned, unstructured, for the pruning methods (default 0.5)",
    )
    q.add_argument("--pattern", default=None, metavar="N:M", help="N:M pruning (2:4, 4:8): N kept of every M inputs")
    q.add_argument(
        "--then",
        default=None,
        metavar="FORMAT",
        help="after pruning, quantize with this format or method (q8_0, q4_0, int8, awq, ...; default: keep float)",
    )
    q.add_argument(
        "--include-lm-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantize the LM head too, or keep it float (default: float, but smoothquant quantizes it)",
    )
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument(
        "--save-format",
        choices=["fastdecode", "compressed-tensors"],
        default="fastdecode",
        help="fastdecode's layout, or compressed-tensors for other engines (q4_0, q8_0, int8, w8a8 and "
        "smoothquant/awq in those formats; default: %(default)s)",
    )
    q.add_argument("--trust-remote-code", action="store_true")
    q.add_argument(
        "--eval-windows",
        type=bounded(int, "an integer >= 0", low=0),
        default=2,
        metavar="N",
        help="windows of the quality report printed after saving (0: no report; default: %(default)s)",
    )
    _add_text_args(q)
    q.set_defaults(func=cmd_compress)


def build_parser() -> argparse.ArgumentParser:
    from fastdecode.bench.cli import add_bench_parser
    from fastdecode.bench.probe import add_probe_parser
    from fastdecode.bench.scale_report import add_bench_scale_parser
    from fastdecode.bench.serve import add_bench_serve_parser
    from fastdecode.bench.synthetic_gguf import add_make_gguf_parser
    from fastdecode.bench.throughput import add_throughput_parser
    from fastdecode.distill.command import add_distill_parser
    from fastdecode.formats import compress_method_names
    from fastdecode.scaleout.options import add_batch_args
    from fastdecode.server.cli import add_serve_parser

    parser = ArgumentParser(prog="fastdecode", description="Lossless speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    EngineArgs.add_cli_args(g, groups=("model",))
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    src.add_argument(
        "--prompts-file",
        help='many prompts, one JSON object per line ({"prompt": ..., optional "id", '
        '"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "speculate", "kv_policy"}), decoded '
        "together by continuous batching; prints one JSON result per line, in input order",
    )
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="send the raw prompt, without the chat template")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--stream", action="store_true", help="print text as it is decoded")
    out.add_argument("--json", action="store_true", help="print one JSON object with the text and metrics")
    add_decoding_args(g)
    EngineArgs.add_cli_args(g, groups=("drafter", "batching"))
    add_batch_args(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="plain vs speculative decoding side by side on the embedded model")
    EngineArgs.add_cli_args(d, groups=("model",))
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.set_defaults(func=cmd_demo)

    _add_compress_parser(sub, compress_method_names())
    _add_eval_parser(sub)

    add_bench_parser(sub)
    add_probe_parser(sub)
    add_distill_parser(sub)
    add_throughput_parser(sub)
    add_bench_serve_parser(sub)
    add_bench_scale_parser(sub)
    add_make_gguf_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fastdecode.kernels.threads import quiet_openmp_wait

    quiet_openmp_wait()  # before torch loads OpenMP: idle workers spin briefly, then sleep
    return run_main(build_parser, argv)
