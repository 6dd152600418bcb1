"""``fastdecode bench --long-context``: speed, KV cache size and quality at long contexts, per
KV cache type (``--kv-cache-dtype``) and KV policy.

What it measures, on the long text shipped in the package (WikiText-2's raw test split,
``fastdecode.data.corpora.evaluation_text``, tokenized once; ~300k tokens for SmolLM2):

* **speed**: for each cache type, policy and prompt length (default 1k, 2k, 4k and 8k
  tokens, the text's first tokens; cut to ``context - decode_tokens`` where the model's
  context is shorter, which the table shows), greedy plain decoding of ``decode_tokens``
  new tokens on a fresh request (no prefix-cache hit), after one warm-up run per target.
  ``prefill_tokens_per_s`` is prompt tokens / time to first token (the engine's chunked
  prefill, 256 rows a pass by default); ``decode_tokens_per_s``
  the tokens after the first over their time (the median of ``repeats`` runs);
  ``kv_cache_mib`` the most KV blocks the request held, in MiB as stored (a q8_0 block
  counts its int8 values and fp16 scales).
* **quality**: per cache type, perplexity over windows of ``ppl_window_tokens`` of the text
  (``fastdecode.evaluation.quality``'s windows, each on a fresh cache), with top-1 agreement and
  KL against the same weights over a float32 cache - what the cache alone costs.
* **llama.cpp** (when llama-cpp-python is installed and the model is a GGUF file): the same
  prompts on the same file, its cache in the same types (``-ctk`` / ``-ctv``: q8_0, q4_0,
  f16, f32), flash attention on (its quantized V cache needs it).

A KV policy other than ``full`` is handed to the engine as ``EngineArgs.kv_policy`` (the
policies' own options at their defaults); perplexity under a policy (a text longer than
the window, evicting as it goes) is the policies' own benchmark, not this one's.

A benchmark prints figures; it asserts nothing. Run it on a quiet machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastdecode.args import EngineArgs
from fastdecode.errors import ConfigError

DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192)
DEFAULT_KV_CACHE_DTYPES = ("float32", "float16", "q8_0", "q4_0")
# --kv-cache-dtype -> llama.cpp's (type_k, type_v) names (ggml types)
LLAMA_CPP_TYPES = {"float32": "F32", "float16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


@dataclass(frozen=True)
class LongContextSpec:
    """What to run: the model (``engine_args``, its ``kv_cache_dtype`` replaced per run), the
    cache types, policies and prompt lengths, and the quality windows."""

    engine_args: EngineArgs
    kv_cache_dtypes: tuple[str, ...] = DEFAULT_KV_CACHE_DTYPES
    kv_policies: tuple[str, ...] = ("full",)
    context_tokens: tuple[int, ...] = DEFAULT_CONTEXTS
    decode_tokens: int = 32
    repeats: int = 1
    ppl_window_tokens: int = 4096  # at most the model's context
    ppl_windows: int = 4  # 0: no quality
    llama_cpp: bool = True  # when it can run

    def __post_init__(self) -> None:
        if not self.kv_cache_dtypes or not self.kv_policies or not self.context_tokens:
            raise ConfigError("the long-context benchmark needs cache types, policies and prompt lengths")
        if min(self.context_tokens) < 2 or self.decode_tokens < 2 or self.repeats < 1 or self.ppl_windows < 0:
            raise ConfigError(
                "--context-tokens >= 2, --decode-tokens >= 2, --repeats >= 1 and --ppl-windows >= 0, please"
            )
        if self.ppl_window_tokens < 2:
            raise ConfigError(f"--ppl-window must be >= 2 tokens, got {self.ppl_window_tokens}")


@dataclass
class SpeedRow:
    engine: str  # "fastdecode" or "llama.cpp"
    kv_cache_dtype: str
    kv_policy: str
    context_tokens: int  # as asked
    prompt_tokens: int  # as run (the context cut to leave room for decode_tokens)
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float | None
    kv_cache_mib: float


@dataclass
class QualityRow:
    kv_cache_dtype: str
    perplexity: float
    top1_agreement: float  # against the same weights over a float32 cache
    kl: float  # mean KL(float32 cache || this cache) per predicted token, nats
    float32_perplexity: float
    window_tokens: int
    num_windows: int
    num_tokens: int


@dataclass
class LongContextRun:
    model: str
    weights: str
    text_tokens: int
    speed: list[SpeedRow] = field(default_factory=list)
    quality: list[QualityRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- fastdecode


def _engine_args(base: EngineArgs, kv_cache_dtype: str, policy: str) -> EngineArgs:
    """One run's options: the cache type, the policy, one sequence, no prefix cache."""
    extra = {}
    if policy != "full":
        if "kv_policy" not in {f.name for f in dataclasses.fields(EngineArgs)}:
            raise ConfigError(f"--kv-policies {policy}: this build has no KV policy but full")
        extra["kv_policy"] = policy
    return dataclasses.replace(
        base, kv_cache_dtype=kv_cache_dtype, max_num_seqs=1, enable_prefix_caching=False, drafter="none", **extra
    )


def _prompt_length(context: int, context_length: int, decode_tokens: int) -> int:
    return min(context, context_length - decode_tokens - 1)


def _timed_request(engine, prompt: list[int], decode_tokens: int) -> tuple:
    """(GenerationResult, the most KV blocks the request held) of one greedy request."""
    from fastdecode.engine import GenerationConfig

    stream = engine.stream(prompt, GenerationConfig(max_new_tokens=decode_tokens), chat=False)
    held = 0
    for _ in stream:
        pool = engine.kv_cache.pool
        held = max(held, pool.num_blocks - pool.num_free)
    return stream.result, held


def _speed_rows(spec: LongContextSpec, model, tokenizer, ids: list[int], kv: str, policy: str) -> list[SpeedRow]:
    args = _engine_args(spec.engine_args, kv, policy)
    engine = args.create_engine(model=model, tokenizer=tokenizer)
    target = engine.target
    block_mib = target.kv_block_bytes(engine.scheduler.block_size) / 2**20
    engine.generate(ids[:64], max_new_tokens=4, chat=False)  # warm-up: kernels built, caches touched
    rows = []
    for context in spec.context_tokens:
        n = _prompt_length(context, target.context_length, spec.decode_tokens)
        runs = [_timed_request(engine, ids[:n], spec.decode_tokens) for _ in range(spec.repeats)]
        results = [r for r, _ in runs]
        decode = [r.decode_tokens_per_s for r in results if r.num_new_tokens > 1]
        rows.append(
            SpeedRow(
                "fastdecode",
                target.kv_cache_dtype,
                policy,
                context,
                n,
                statistics.median(r.num_new_tokens for r in results),
                statistics.median(n / r.ttft_s for r in results),
                statistics.median(decode) if decode else None,
                max(h for _, h in runs) * block_mib,
            )
        )
    engine.free_kv_cache()
    return rows


def _quality_rows(spec: LongContextSpec, model, tokenizer, ids: list[int], notes: list[str]) -> list[QualityRow]:
    from fastdecode.evaluation.quality import score_windows, windows

    base = spec.engine_args
    reference = dataclasses.replace(base, kv_cache_dtype="float32").create_target(model, tokenizer)
    window = min(spec.ppl_window_tokens, reference.context_length)
    if window < spec.ppl_window_tokens:
        notes.append(f"perplexity windows cut to the model's context, {window} tokens")
    spans = windows(len(ids), window)[: spec.ppl_windows]
    float32 = score_windows(reference, ids, spans)
    rows = []
    for kv in spec.kv_cache_dtypes:
        target = dataclasses.replace(base, kv_cache_dtype=kv).create_target(model, tokenizer)
        if target.kv_cache_dtype == "float32":
            s, agree, kl = float32, 1.0, 0.0
        else:
            s = score_windows(target, ids, spans, reference=reference)
            agree, kl = s.agree / s.count, s.kl / s.count
        rows.append(
            QualityRow(target.kv_cache_dtype, s.perplexity, agree, kl, float32.perplexity, window, len(spans), s.count)
        )
    return rows


# ---------------------------------------------------------------- llama.cpp


def llama_cpp_unavailable(model_spec: str) -> str | None:
    """None when llama.cpp can run ``model_spec`` here, else why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama.cpp not run: llama-cpp-python is not installed (pip install llama-cpp-python)"
    from fastdecode.errors import FastDecodeError
    from fastdecode.loading import resolve_spec

    try:
        if resolve_spec(model_spec).kind == "gguf":
            return None
    except FastDecodeError:
        pass
    return f"llama.cpp not run: {model_spec} is not a GGUF file"


def _llama_cpp_rows(spec: LongContextSpec, target, ids: list[int], kv: str) -> list[SpeedRow]:
    """The prompts on llama.cpp with its cache in ``kv`` (keys/values apart as -ctk / -ctv)."""
    import llama_cpp

    from fastdecode.kernels.kv_formats import parse_kv_cache_dtype
    from fastdecode.loading import resolve_spec

    k, v = parse_kv_cache_dtype(kv, torch.float32)
    types = [getattr(llama_cpp, f"GGML_TYPE_{LLAMA_CPP_TYPES[f.name]}") for f in (k, v)]
    llm = llama_cpp.Llama(
        model_path=resolve_spec(spec.engine_args.model).location,
        n_ctx=target.context_length,
        n_threads=torch.get_num_threads(),
        type_k=types[0],
        type_v=types[1],
        flash_attn=True,  # its quantized V cache needs flash attention; on for every type alike
        verbose=False,
    )
    row_bytes = sum(f.row_bytes(target.head_dim) for f in (k, v)) * len(target.layers) * target.n_kv_heads
    rows = []
    llm.generate(ids[:64], temp=0.0, reset=True).__next__()  # warm-up
    for context in spec.context_tokens:
        n = _prompt_length(context, target.context_length, spec.decode_tokens)
        runs = [_llama_cpp_request(llm, ids[:n], spec.decode_tokens) for _ in range(spec.repeats)]
        decode = [d for _, _, d in runs if d is not None]
        rows.append(
            SpeedRow(
                "llama.cpp",
                kv,
                "full",
                context,
                n,
                statistics.median(m for m, _, _ in runs),
                statistics.median(p for _, p, _ in runs),
                statistics.median(decode) if decode else None,
                (n + spec.decode_tokens) * row_bytes / 2**20,
            )
        )
    return rows


def _llama_cpp_request(llm, prompt: list[int], decode_tokens: int) -> tuple[int, float, float | None]:
    """(new tokens, prefill tok/s, decode tok/s) of one greedy request (EOS ignored: a fixed length)."""
    # llama-cpp-python keeps the evaluated tokens and, even with reset=True, evaluates only what
    # follows their longest common prefix: without this a 4k prompt after the 1k one (or a repeat)
    # would prefill only its new tokens and report them as the whole prompt's speed
    llm.reset()
    t0 = time.perf_counter()
    t_first, n = None, 0
    for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
        if n >= decode_tokens:
            break
    t_end = time.perf_counter()
    return n, len(prompt) / (t_first - t0), (n - 1) / (t_end - t_first) if n > 1 else None


# ---------------------------------------------------------------- the run


def run_long_context(spec: LongContextSpec, progress=print) -> LongContextRun:
    from fastdecode.data import corpora
    from fastdecode.evaluation.quality import tokenize

    model, tokenizer = spec.engine_args.load_model()
    ids = tokenize(tokenizer, corpora.evaluation_text())
    run = LongContextRun(spec.engine_args.model, spec.engine_args.weights, len(ids))
    if len(ids) < max(spec.context_tokens):
        raise ConfigError(f"the text is {len(ids)} tokens: too short for a {max(spec.context_tokens)}-token prompt")
    for kv in spec.kv_cache_dtypes:
        for policy in spec.kv_policies:
            progress(f"fastdecode, {kv} cache, {policy} policy")
            run.speed += _speed_rows(spec, model, tokenizer, ids, kv, policy)
    if spec.llama_cpp:
        why = llama_cpp_unavailable(spec.engine_args.model)
        if why is not None:
            run.notes.append(why)
        else:
            target = spec.engine_args.create_target(model, tokenizer)
            for kv in spec.kv_cache_dtypes:
                progress(f"llama.cpp, {kv} cache")
                run.speed += _llama_cpp_rows(spec, target, ids, kv)
    if spec.ppl_windows:
        progress("perplexity")
        run.quality = _quality_rows(spec, model, tokenizer, ids, run.notes)
    return run


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tables(run: LongContextRun) -> str:
    """The run as markdown: speed and cache size, then quality."""
    from fastdecode.bench.report import md_table

    speed = md_table(
        ["engine", "KV cache", "policy", "context", "prompt tokens", "new tokens"]
        + ["prefill tok/s", "decode tok/s", "cache MiB"],
        [
            [r.engine, r.kv_cache_dtype, r.kv_policy, r.context_tokens, r.prompt_tokens, r.new_tokens]
            + [_f(r.prefill_tokens_per_s), _f(r.decode_tokens_per_s), _f(r.kv_cache_mib, 2)]
            for r in run.speed
        ],
    )
    out = f"Long-context speed ({run.model}, weights {run.weights})\n\n{speed}"
    if run.quality:
        q = run.quality[0]
        quality = md_table(
            ["KV cache", "perplexity", "vs float32 cache", "top-1 agreement", "KL (nats)"],
            [
                [r.kv_cache_dtype, _f(r.perplexity, 3), f"{r.perplexity / r.float32_perplexity - 1:+.2%}"]
                + [f"{r.top1_agreement:.4f}", f"{r.kl:.5f}"]
                for r in run.quality
            ],
        )
        out += (
            f"\n\nQuality: {q.num_windows} window(s) of {q.window_tokens} tokens, {q.num_tokens} predicted\n\n{quality}"
        )
    return out + "".join(f"\nnote: {n}" for n in run.notes)


def write_run(run: LongContextRun, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.to_dict(), indent=2) + "\n")
    return path
