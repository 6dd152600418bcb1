"""``fastdecode bench-scale``'s command line and output: the machine, a table (stdout and
results.md), results.json and scale.png."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastdecode.bench.scale import (
    DEFAULT_LLAMA_CPP_BIN,
    FASTDECODE,
    LLAMA_CPP,
    RATIO_FIGURES,
    ScaleRow,
    ScaleSettings,
    ratio_text,
    rows_as_dicts,
    run_scale,
    settings_from_args,
)
from fastdecode.bench.scale import __doc__ as scale_doc
from fastdecode.bench.synthetic_gguf import SHAPES, TYPES

HEADERS = (
    "shape",
    "type",
    "file GiB",
    "engine",
    "load first s",
    "load s",
    "peak RSS GiB",
    "RSS / file",
    "load-only RSS GiB",
    "prefill tok/s",
    "decode tok/s @1",
    "decode tok/s @B",
)
_ISA = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")
_ISA += ("amx_tile", "amx_int8", "amx_bf16")


def machine() -> dict:
    """fastdecode's machine description (CPU model, cores, load, versions) with the CPU's vector
    extensions and the llama.cpp build in use (``.peer/llama.cpp/BUILD``, from scripts/setup_peer.sh)."""
    from fastdecode.bench.report import machine_description

    described = machine_description()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        flags = []
    described["cpu_flags"] = [f for f in _ISA if f in flags]
    return described


def _llama_cpp_build(bin_dir: str | None) -> str | None:
    if bin_dir is None:
        return None
    build_file = Path(bin_dir).parent.parent / "BUILD"  # <peer>/build/bin -> <peer>/BUILD
    return build_file.read_text().strip() if build_file.exists() else None


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table_rows(rows: list[ScaleRow]) -> list[list[str]]:
    out = []
    for r in rows:
        ratio = None if r.peak_rss_bytes is None else r.peak_rss_bytes / r.file_bytes
        out.append(
            [
                r.shape,
                r.file_type,
                _gib(r.file_bytes),
                r.engine,
                _f(r.load_first_s, 2),
                _f(r.load_s, 2),
                _gib(r.peak_rss_bytes),
                _f(ratio, 2),
                _gib(r.peak_rss_load_bytes),
                _f(r.prefill_tokens_per_s),
                _f(r.decode_tokens_per_s_1),
                _f(r.decode_tokens_per_s_batch),
            ]
        )
    return out


def ratio_rows(per_file: dict[str, dict]) -> list[list[str]]:
    """Per file that llama.cpp ran, fastdecode / llama.cpp of each speed (the load: llama.cpp /
    fastdecode): the median of the rounds' paired ratios, then each round's."""
    return [
        [name] + [ratio_text(found["ratios"][figure], bold=True) for figure in RATIO_FIGURES]
        for name, found in per_file.items()
        if LLAMA_CPP in found["rounds"]
    ]


RATIO_HEADERS = ("file", *RATIO_FIGURES.values())


def render_markdown(
    rows: list[ScaleRow], settings: ScaleSettings, described: dict, llama_note: str, per_file: dict | None = None
) -> str:
    from fastdecode.bench.report import md_table

    cpu = f"{described['cpu']}, {described['usable_cores']} usable of {described['logical_cores']} logical cores"
    lines = [
        "# fastdecode bench-scale",
        "",
        f"- machine: {cpu}; vector extensions: {', '.join(described['cpu_flags']) or 'none found'}; "
        f"load average {described['load_average']} at the end; {described['date']}",
        f"- llama.cpp: {(_llama_cpp_build(settings.llama_cpp_bin) or llama_note or 'build unknown').splitlines()[0]}",
        f"- prefill: one {settings.prompt_tokens}-token prompt; decode: {settings.decode_tokens} tokens after a "
        f"{16}-token prompt, at 1 and at B = {settings.batch} requests at once (tokens of all requests per second); "
        f"median of {settings.repeats}; plain greedy decoding, warm-up excluded; threads: "
        f"{settings.threads or 'each engine its default'}; {settings.rounds} round(s): the engines take turns "
        "on each file, each row the median of its rounds (peak memory: the largest)",
        "- load first: a fresh process that only loads (cold process, warm page cache); load: the measuring "
        "process's; both to the end of a first small evaluation (llama.cpp's own load time)",
        "- peak RSS: the measuring process's peak resident memory (VmHWM; llama.cpp: llama-batched-bench at B); "
        "load-only RSS: the load-only process's",
        "",
        md_table(HEADERS, table_rows(rows)),
    ]
    paired = ratio_rows(per_file or {})
    if paired:
        lines += ["", "fastdecode / llama.cpp, round by round (median first):", "", md_table(RATIO_HEADERS, paired)]
    notes = [f"- {r.engine} {r.shape} {r.file_type}: {r.note}" for r in rows if r.note]
    if notes or llama_note:
        lines += ["", "Notes:", ""] + notes + ([f"- {llama_note}"] if llama_note else [])
    return "\n".join(lines) + "\n"


def write_plot(path: Path, rows: list[ScaleRow], batch: int) -> Path:
    """Bars per (shape, type), fastdecode beside llama.cpp: prefill, decode at 1 and at B, peak RSS."""
    from fastdecode.bench.plots import _pyplot

    plt = _pyplot()
    files = list(dict.fromkeys((r.shape, r.file_type) for r in rows))
    panels = (
        ("prefill tok/s", lambda r: r.prefill_tokens_per_s),
        ("decode tok/s, 1 request", lambda r: r.decode_tokens_per_s_1),
        (f"decode tok/s, {batch} requests", lambda r: r.decode_tokens_per_s_batch),
        ("peak RSS / file size", lambda r: None if r.peak_rss_bytes is None else r.peak_rss_bytes / r.file_bytes),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    width = 0.38
    for ax, (title, value) in zip(axes[0], panels):
        for k, engine in enumerate((FASTDECODE, LLAMA_CPP)):
            by_file = {(r.shape, r.file_type): value(r) for r in rows if r.engine == engine}
            ys = [by_file.get(f) or 0.0 for f in files]
            ax.bar([i + (k - 0.5) * width for i in range(len(files))], ys, width, label=engine)
        ax.set_xticks(range(len(files)), [f"{s}\n{t}" for s, t in files], fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from fastdecode.bench.report import md_table

    settings = settings_from_args(args)
    rows, llama_note, per_file = run_scale(settings)
    described = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": described, "settings": vars(settings), "llama_cpp_build": None, "rows": rows_as_dicts(rows)}
    results["files"] = per_file
    results["llama_cpp_build"] = _llama_cpp_build(settings.llama_cpp_bin)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(render_markdown(rows, settings, described, llama_note, per_file))
    print(md_table(HEADERS, table_rows(rows)))
    paired = ratio_rows(per_file)
    if paired:
        print(md_table(RATIO_HEADERS, paired))
    if llama_note:
        print(llama_note)
    written = [out / "results.json", out / "results.md"]
    if not args.no_plot and rows:
        written.append(write_plot(out / "scale.png", rows, settings.batch))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_bench_scale_parser(subparsers) -> argparse.ArgumentParser:
    from fastdecode.args import EngineArgs
    from fastdecode.kernels.build import cache_root

    p = subparsers.add_parser(
        "bench-scale",
        help="fastdecode vs llama.cpp on random-weight GGUF files of real model sizes: load, memory, speed",
        description=" ".join(scale_doc.split("\n\n")[1].split()),
    )
    p.add_argument("--shapes", default="llama-3.2-1b", help=f"comma list of {', '.join(SHAPES)} (default: %(default)s)")
    p.add_argument("--types", default="q4_k_m", help=f"comma list of {', '.join(TYPES)} (default: %(default)s)")
    p.add_argument(
        "--cache-dir",
        default=str(cache_root() / "synthetic-gguf"),
        help="where the generated files are kept, written once (default: %(default)s)",
    )
    p.add_argument(
        "--out", default="bench-out/scale", help="results.json, results.md, scale.png (default: %(default)s)"
    )
    p.add_argument("--prompt-tokens", type=int, default=512, help="prefill prompt length (default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per request (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="requests decoding at once (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each speed, median (default: %(default)s)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="turns of the two engines on each file, one after the other; rows are the medians and each "
        "round's ratio is reported (default: %(default)s)",
    )
    EngineArgs.add_cli_args(
        p,
        only=("weights", "threads"),
        help_text={
            "weights": "fastdecode's --weights (default: %(default)s)",
            "threads": "both engines' threads, fixed (llama.cpp's -t; default: each engine its own default)",
        },
    )
    p.add_argument(
        "--llama-cpp-bin",
        default=DEFAULT_LLAMA_CPP_BIN,
        help="llama-bench and llama-batched-bench are here; 'none' skips llama.cpp (default: %(default)s)",
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per process (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true", help="no scale.png")
    p.set_defaults(func=cmd_bench_scale)
    return p
