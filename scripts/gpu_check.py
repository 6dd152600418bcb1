"""On a CUDA machine: the engine's exactness on the GPU, without the embedded model.

Builds the tests' tiny random-weight Llama (tests/conftest.py) on ``cuda``, then checks
that speculative greedy output equals plain decoding for several drafters, on the
native decoder (torch's ops on the GPU, float32 and bfloat16) and on transformers, at
batch 1 and 4, plainly and under logits processors (penalties, logit_bias, min_tokens, a
regex grammar, logprobs). Prints one line per case and exits non-zero on a mismatch. Run from
the repository root: ``python scripts/gpu_check.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src"), str(Path(__file__).resolve().parents[1] / "tests")]

from conftest import CharTokenizer, build_tiny_llama  # noqa: E402

from fastdecode import Engine, GrammarSpec, build_drafter  # noqa: E402
from fastdecode.backends import make_target  # noqa: E402

PROCESSORS = dict(
    frequency_penalty=0.6,
    presence_penalty=0.3,
    repetition_penalty=1.2,
    logit_bias={40: 2.0, 41: -100},
    min_tokens=4,
    grammar=GrammarSpec("regex", "[a-f ]{4,30}( [0-9]+)?"),
    logprobs=2,
)


def check(model, tokenizer, backend: str, drafter: str, prompts: list[str], options: dict) -> bool:
    target = make_target(model, backend)
    plain = Engine(model, tokenizer, target=target).generate(prompts, max_new_tokens=48, **options)
    spec = Engine(model, tokenizer, drafter=build_drafter(drafter), target=target).generate(
        prompts, max_new_tokens=48, **options
    )
    same = [a.token_ids == b.token_ids for a, b in zip(plain, spec)]
    what = "processors" if options else "plain"
    print(
        f"{backend:6} {str(model.dtype):15} {drafter:14} {what:10} batch {len(prompts)}: "
        f"{'identical' if all(same) else 'DIFFERENT'}"
    )
    return all(same)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    tokenizer = CharTokenizer()
    prompts = ["abcabcabcabc abc", "the cat sat on the mat, the cat", "0101010101", "xyz xyz xyz"]
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        model = build_tiny_llama().to("cuda", dtype)
        for backend in ("native", "hf") if dtype == torch.float32 else ("native",):
            for drafter in ("ngram", "prompt-lookup", "suffix"):
                for batch in (prompts[:1], prompts) if backend == "native" else (prompts[:1],):
                    for options in ({}, PROCESSORS):
                        ok &= check(model, tokenizer, backend, drafter, batch, options)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
