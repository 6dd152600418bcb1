"""``fastdecode bench-scale``: fastdecode and llama.cpp on the same GGUF file at real model sizes.

Per shape and weight type (random-weight files from ``fastdecode.bench.synthetic_gguf``,
written once under ``--cache-dir``), one run measures each engine in processes of its own:

* **load time**: first, a fresh process that only loads (cold process, warm page cache: the
  file was just written or read, and dropping the page cache needs root); later, the
  measuring process's load. Both engines count from the start of loading to the end of a
  first small evaluation (llama.cpp's own "load time"; mapped weights are read on first use);
* **peak resident memory**: the measuring process's peak RSS (``ru_maxrss`` of the child,
  its VmHWM), and the load-only process's;
* **prefill tok/s** on a ``--prompt-tokens`` prompt; **decode tok/s** at 1 request and at
  ``--batch`` requests at once (plain decoding, greedy; warm-up excluded).

With ``--rounds N`` the two engines take turns on each file, N times (fastdecode, llama.cpp,
fastdecode, ...): a machine whose memory bandwidth drifts over minutes (a shared host's) moves both
engines' figures of one round alike, so the ratio of a round's pair holds where one engine's figure
alone would not. Each engine's row holds the median of its rounds (peak memory: the largest), and
:func:`paired_ratios` gives every round's fastdecode / llama.cpp ratio and their median.

fastdecode runs ``python -m fastdecode.bench.scale_job`` (``EngineArgs(...).create_engine()``,
as a user's program). llama.cpp runs its own tools from ``--llama-cpp-bin`` (built by
``scripts/setup_peer.sh``): ``llama-bench -p P -n N`` for prefill and single-request decode,
``llama-batched-bench -npl B`` for the batch, and a minimal ``llama-batched-bench`` as the
load-only process. Both get ``--threads``. Writes ``results.json``, ``results.md`` and
``scale.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median

from fastdecode.bench.synthetic_gguf import SHAPES, TYPES, synthetic_gguf
from fastdecode.errors import ConfigError

FASTDECODE, LLAMA_CPP = "fastdecode", "llama.cpp"
DEFAULT_LLAMA_CPP_BIN = ".peer/llama.cpp/build/bin"  # scripts/setup_peer.sh, from the repository root
SHORT_PROMPT_TOKENS = 16  # the decode runs' prompts (as scale_job's)


@dataclass
class ScaleRow:
    """One engine on one file; speeds in tokens per second, memory in bytes, None where not measured."""

    shape: str
    file_type: str
    file_bytes: int
    engine: str
    load_first_s: float | None = None
    load_s: float | None = None
    peak_rss_load_bytes: int | None = None
    peak_rss_bytes: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s_1: float | None = None
    decode_tokens_per_s_batch: float | None = None
    note: str = ""


@dataclass
class ScaleSettings:
    shapes: list[str]
    types: list[str]
    cache_dir: str
    prompt_tokens: int = 512
    decode_tokens: int = 64
    batch: int = 8
    repeats: int = 1
    rounds: int = 1  # turns of the two engines on each file (A B A B ...); rows are the rounds' medians
    threads: int | None = None
    weights: str | None = None  # fastdecode's --weights; None: its default
    llama_cpp_bin: str | None = DEFAULT_LLAMA_CPP_BIN
    timeout_s: float = 3600.0


@dataclass
class ChildRun:
    returncode: int
    stdout: str
    stderr: str
    peak_rss_bytes: int  # the command's own peak resident memory (VmHWM); 0 if it was killed
    wall_s: float


# A child's ru_maxrss counts the memory of the process it was forked from (Linux records the
# forked copy's peak at exec; subprocess's vfork shares the parent's memory outright), so a
# child of a large benchmark or test process would report that process's size. This launcher
# (a bare Python, ~10 MB) forks and execs the command and reports the command's own peak.
_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as fh:
    fh.write(str(usage.ru_maxrss * 1024))
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_child(cmd: list[str], timeout_s: float, env: dict | None = None) -> ChildRun:
    """Run ``cmd`` to its end (its process group killed past ``timeout_s``) and read its own peak
    resident memory (``ru_maxrss`` from ``wait4`` in a small launcher: the command's VmHWM)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path, rss_path = (Path(tmp) / n for n in ("out", "err", "rss"))
        launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(rss_path), *cmd]
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                launcher, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True
            )
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the command
                proc.wait()
        wall = time.perf_counter() - t0
        peak = int(rss_path.read_text()) if rss_path.exists() else 0
        text = out_path.read_bytes().decode(errors="replace"), err_path.read_bytes().decode(errors="replace")
    return ChildRun(proc.returncode, *text, peak, wall)


def _tail(run: ChildRun) -> str:
    lines = (run.stderr.strip() or run.stdout.strip()).splitlines()
    return f"exit {run.returncode}: {lines[-1][:300] if lines else 'no output'}"


# ------------------------------------------------------------------ fastdecode


def _fastdecode_job(settings: ScaleSettings, path: Path, load_only: bool) -> list[str]:
    cmd = [sys.executable, "-m", "fastdecode.bench.scale_job", "--model", str(path)]
    cmd += ["--prompt-tokens", str(settings.prompt_tokens), "--decode-tokens", str(settings.decode_tokens)]
    cmd += ["--batch", str(settings.batch), "--repeats", str(settings.repeats)]
    if settings.threads is not None:
        cmd += ["--threads", str(settings.threads)]
    if settings.weights is not None:
        cmd += ["--weights", settings.weights]
    return cmd + (["--load-only"] if load_only else [])


def _job_result(run: ChildRun) -> dict | None:
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if run.returncode == 0 and lines else None


def measure_fastdecode(settings: ScaleSettings, row: ScaleRow, path: Path) -> ScaleRow:
    first = run_child(_fastdecode_job(settings, path, load_only=True), settings.timeout_s)
    loaded = _job_result(first)
    if loaded is None:
        row.note = f"load failed ({_tail(first)})"
        return row
    row.load_first_s, row.peak_rss_load_bytes = loaded["load_s"], first.peak_rss_bytes
    full = run_child(_fastdecode_job(settings, path, load_only=False), settings.timeout_s)
    result = _job_result(full)
    if result is None:
        row.note = f"run failed ({_tail(full)})"
        return row
    row.load_s, row.peak_rss_bytes = result["load_s"], full.peak_rss_bytes
    row.prefill_tokens_per_s = result["prefill_tokens_per_s"]
    row.decode_tokens_per_s_1 = result["decode_tokens_per_s_1"]
    row.decode_tokens_per_s_batch = result["decode_tokens_per_s_batch"]
    row.note = f"{result['backend']} backend, weights {result['weights']}, {result['threads']} threads"
    return row


# ------------------------------------------------------------------ llama.cpp

_LOAD_TIME = re.compile(r"load time =\s*([0-9.]+) ms")


def llama_cpp_tools(bin_dir: str | None) -> tuple[Path | None, str]:
    """The directory holding llama-bench and llama-batched-bench, or None and why not."""
    if bin_dir is None:
        return None, "llama.cpp not run (--llama-cpp-bin none)"
    path = Path(bin_dir)
    missing = [t for t in ("llama-bench", "llama-batched-bench") if not os.access(path / t, os.X_OK)]
    if missing:
        return None, f"llama.cpp not run: no {', '.join(missing)} in {path} (build it: scripts/setup_peer.sh)"
    return path, ""


def _batched_bench(tools: Path, settings: ScaleSettings, path: Path, prompt: int, gen: int, seqs: int) -> list[str]:
    ctx = max(256, seqs * (prompt + gen))
    batch = str(min(2048, ctx))
    cmd = [str(tools / "llama-batched-bench"), "-m", str(path), "-c", str(ctx), "-b", batch, "-ub", str(min(512, ctx))]
    cmd += ["-npp", str(prompt), "-ntg", str(gen), "-npl", str(seqs), "--output-format", "jsonl"]
    cmd += ["-lv", "4"]  # llama_perf_context_print's "load time" is logged from verbosity 4 (trace), not debug
    return cmd + (["-t", str(settings.threads)] if settings.threads is not None else [])


def _load_ms(run: ChildRun) -> float | None:
    found = _LOAD_TIME.findall(run.stderr + run.stdout)
    return float(found[-1]) / 1000 if found else None


def _jsonl(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(json.JSONDecodeError):  # a log line that looks like JSON
                rows.append(json.loads(line))
    return rows


def measure_llama_cpp(settings: ScaleSettings, row: ScaleRow, path: Path, tools: Path) -> ScaleRow:
    first = run_child(_batched_bench(tools, settings, path, 8, 1, 1), settings.timeout_s)
    if first.returncode != 0:
        row.note = f"load failed ({_tail(first)})"
        return row
    row.load_first_s, row.peak_rss_load_bytes = _load_ms(first), first.peak_rss_bytes
    bench = [str(tools / "llama-bench"), "-m", str(path), "-p", str(settings.prompt_tokens)]
    bench += ["-n", str(settings.decode_tokens), "-r", str(settings.repeats), "-o", "json"]
    bench += ["-t", str(settings.threads)] if settings.threads is not None else []
    single = run_child(bench, settings.timeout_s)
    try:
        tests = json.loads(single.stdout[single.stdout.index("[") :]) if single.returncode == 0 else []
    except ValueError:
        tests = []
    for t in tests:
        if t.get("n_gen") == 0:
            row.prefill_tokens_per_s = t["avg_ts"]
        elif t.get("n_prompt") == 0:
            row.decode_tokens_per_s_1 = t["avg_ts"]
    batched = run_child(
        _batched_bench(tools, settings, path, SHORT_PROMPT_TOKENS, settings.decode_tokens, settings.batch),
        settings.timeout_s,
    )
    found = [r for r in _jsonl(batched.stdout + "\n" + batched.stderr) if r.get("pl") == settings.batch]
    if found:
        row.decode_tokens_per_s_batch = found[-1]["speed_tg"]
    row.load_s, row.peak_rss_bytes = _load_ms(batched), batched.peak_rss_bytes
    notes = [f"llama-bench {_tail(single)}"] if not tests else []
    notes += [f"llama-batched-bench {_tail(batched)}"] if not found else []
    row.note = "; ".join(notes)
    return row


# ------------------------------------------------------------------ the run


_SPEEDS = ("prefill_tokens_per_s", "decode_tokens_per_s_1", "decode_tokens_per_s_batch")
_TIMES = ("load_first_s", "load_s")
_PEAKS = ("peak_rss_load_bytes", "peak_rss_bytes")
# the figures paired_ratios compares, with their labels (the load's ratio is llama.cpp / fastdecode)
RATIO_FIGURES = {
    "prefill_tokens_per_s": "prefill",
    "decode_tokens_per_s_1": "decode @1",
    "decode_tokens_per_s_batch": "decode @B",
    "load_s": "load (llama.cpp / fastdecode)",
}


def combine_rounds(rounds: list[ScaleRow]) -> ScaleRow:
    """One engine's rounds on one file as one row: each speed and time the median of the rounds that
    measured it, each peak memory the largest; the note of the first round, with the count."""
    first = rounds[0]
    row = ScaleRow(first.shape, first.file_type, first.file_bytes, first.engine)
    for name in _SPEEDS + _TIMES:
        got = [getattr(r, name) for r in rounds if getattr(r, name) is not None]
        setattr(row, name, median(got) if got else None)
    for name in _PEAKS:
        got = [getattr(r, name) for r in rounds if getattr(r, name) is not None]
        setattr(row, name, max(got) if got else None)
    notes = list(dict.fromkeys(r.note for r in rounds if r.note))
    row.note = "; ".join(notes + ([f"median of {len(rounds)} rounds"] if len(rounds) > 1 else []))
    return row


def paired_ratios(rounds: dict[str, list[ScaleRow]]) -> dict[str, dict]:
    """fastdecode / llama.cpp per round (the two engines' turns on one file, taken one after the other),
    for each speed: ``{figure: {"rounds": [ratio or None per round], "median": median or None}}``; a load
    time's ratio is llama.cpp / fastdecode (above 1: fastdecode loads faster)."""
    ours, theirs = rounds.get(FASTDECODE, []), rounds.get(LLAMA_CPP, [])
    out = {}
    for name in RATIO_FIGURES:
        per = []
        for a, b in zip(ours, theirs):
            x, y = getattr(a, name), getattr(b, name)
            ok = x is not None and y is not None and x > 0 and y > 0
            per.append(None if not ok else (y / x if name == "load_s" else x / y))
        got = [r for r in per if r is not None]
        out[name] = {"rounds": per, "median": median(got) if got else None}
    return out


def run_scale(settings: ScaleSettings, progress=print) -> tuple[list[ScaleRow], str, dict]:
    """Every (shape, type) on both engines, ``settings.rounds`` turns each; returns the rows (one per
    engine and file: the rounds' medians), a note on llama.cpp, and per file ("shape type") its rounds'
    rows and :func:`paired_ratios`."""
    tools, llama_note = llama_cpp_tools(settings.llama_cpp_bin)
    rows: list[ScaleRow] = []
    per_file: dict[str, dict] = {}
    for shape in settings.shapes:
        for file_type in settings.types:
            path = synthetic_gguf(shape, file_type, settings.cache_dir)
            size = path.stat().st_size
            progress(f"bench-scale: {shape} {file_type} ({size / 2**30:.2f} GiB, {path})")
            rounds: dict[str, list[ScaleRow]] = {FASTDECODE: []}
            if tools is not None:
                rounds[LLAMA_CPP] = []
            for turn in range(settings.rounds):
                if settings.rounds > 1:
                    progress(f"  round {turn + 1} of {settings.rounds}")
                row = measure_fastdecode(settings, ScaleRow(shape, file_type, size, FASTDECODE), path)
                progress(_row_line(row))
                rounds[FASTDECODE].append(row)
                if tools is not None:
                    row = measure_llama_cpp(settings, ScaleRow(shape, file_type, size, LLAMA_CPP), path, tools)
                    progress(_row_line(row))
                    rounds[LLAMA_CPP].append(row)
            rows += [combine_rounds(r) for r in rounds.values()]
            ratios = paired_ratios(rounds)
            per_file[f"{shape} {file_type}"] = {
                "rounds": {engine: rows_as_dicts(r) for engine, r in rounds.items()},
                "ratios": ratios,
            }
            if tools is not None:
                each = (f"{label} {ratio_text(ratios[name])}" for name, label in RATIO_FIGURES.items())
                progress(f"  fastdecode / llama.cpp, median of rounds: {'; '.join(each)}")
    return rows, llama_note, per_file


def ratio_text(ratio: dict, bold: bool = False) -> str:
    """One figure of :func:`paired_ratios` as "1.22x (1.22, 1.19, 1.25)": the median, then each round's
    ("-" where none)."""
    if ratio["median"] is None:
        return "-"
    each = ", ".join("-" if x is None else f"{x:.2f}" for x in ratio["rounds"])
    mark = "**" if bold else ""
    return f"{mark}{ratio['median']:.2f}x{mark} ({each})"


def _row_line(row: ScaleRow) -> str:
    speeds = (row.prefill_tokens_per_s, row.decode_tokens_per_s_1, row.decode_tokens_per_s_batch)
    text = " / ".join("-" if s is None else f"{s:.1f}" for s in speeds)
    rss = "-" if row.peak_rss_bytes is None else f"{row.peak_rss_bytes / 2**30:.2f} GiB"
    return f"  {row.engine:10s} prefill / decode@1 / decode@batch tok/s {text}; peak RSS {rss}; {row.note}"


def settings_from_args(args: argparse.Namespace) -> ScaleSettings:
    shapes = [s for s in args.shapes.split(",") if s]
    types = [t for t in args.types.split(",") if t]
    for name, given, known in (("shape", shapes, SHAPES), ("type", types, TYPES)):
        unknown = [g for g in given if g not in known]
        if unknown or not given:
            raise ConfigError(f"unknown {name} {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    for name in ("prompt_tokens", "decode_tokens", "batch", "repeats", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return ScaleSettings(
        shapes=shapes,
        types=types,
        cache_dir=args.cache_dir,
        prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens,
        batch=args.batch,
        repeats=args.repeats,
        rounds=args.rounds,
        threads=args.threads,
        weights=args.weights,
        llama_cpp_bin=None if args.llama_cpp_bin == "none" else args.llama_cpp_bin,
        timeout_s=args.timeout_s,
    )


def rows_as_dicts(rows: list[ScaleRow]) -> list[dict]:
    return [asdict(r) for r in rows]
