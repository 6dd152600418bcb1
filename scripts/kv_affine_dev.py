"""Variants of the q4_0 cache's key affine (backends/kv_calibration.py) on a development text apart
from the evaluation text: 4,096 tokens of Tiny Shakespeare after the calibration's characters, one
window, perplexity and KL against the float32 cache (the same weights).

    PYTHONPATH=src python scripts/kv_affine_dev.py --weights gguf --tokens 4096
"""

from __future__ import annotations

import argparse
import functools

from fastdecode.args import EngineArgs
from fastdecode.data.corpora import calibration_text
from fastdecode.evaluation.quality import score_windows, tokenize, windows
from fastdecode.kv import calibration as kv_calibration

VARIANTS = {  # name -> (key_affine keywords, its mu's positions: "keys" for the keys' own mean); None: no affine
    # (the variants without "+fb" are session 16's, measured before the error feedback: F = 0)
    "plain": None,
    "pair-s+mu4096+fb": (dict(feedback=True), 4096),  # today's default: GPTQ's error feedback on the rounding
    "mu4096+fb": (dict(alpha=0.0, feedback=True), 4096),
    "pair-s+mu8192": (dict(feedback=False), None),
    "pair-s+mu4096": (dict(feedback=False), 4096),
    "mu": (dict(feedback=False, alpha=0.0), None),
    "mu4096": (dict(feedback=False, alpha=0.0), 4096),
    "pair-s.25+mu4096": (dict(feedback=False, alpha=0.25), 4096),
    "pair-s.75+mu4096": (dict(feedback=False, alpha=0.75), 4096),
    "pair-s+keys-mu": (dict(feedback=False), "keys"),
    "ch-s+keys-mu": (dict(feedback=False, tie_pairs=False), "keys"),
}


def _variant(original, keywords: dict, positions):
    if positions == "keys":
        return lambda q, k, rope=None, **kw: original(q, k, None, **keywords, **kw)
    kv_calibration.MU_POSITIONS = positions
    return functools.partial(original, **keywords)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--calibration-tokens", type=int, default=kv_calibration.CALIBRATION_TOKENS)
    a = p.parse_args()
    kv_calibration.CALIBRATION_TOKENS = a.calibration_tokens
    base = EngineArgs(model=a.model, weights=a.weights)
    model, tokenizer = base.load_model()
    ids = tokenize(tokenizer, calibration_text()[kv_calibration.CALIBRATION_CHARS :])[: a.tokens]
    spans = windows(len(ids), len(ids))[:1]
    reference = EngineArgs(model=a.model, weights=a.weights, kv_cache_dtype="float32").create_target(model)
    f32 = score_windows(reference, ids, spans)
    print(
        f"dev text: {len(ids)} tokens of Tiny Shakespeare after the calibration's; float32 {f32.perplexity:.3f}; "
        f"calibration {a.calibration_tokens} tokens"
    )
    args = EngineArgs(model=a.model, weights=a.weights, kv_cache_dtype="q4_0")
    original = kv_calibration.key_affine
    for name in a.variants.split(","):
        variant = VARIANTS[name]
        if variant is not None:
            kv_calibration.key_affine = _variant(original, *variant)
        target = args.create_target(model, tokenizer if variant is not None else None)
        kv_calibration.key_affine, kv_calibration.MU_POSITIONS = original, None
        s = score_windows(target, ids, spans, reference=reference)
        print(
            f"{name:16s} perplexity {s.perplexity:.3f} ({s.perplexity / f32.perplexity - 1:+.2%})  "
            f"KL {s.kl / s.count:.5f}  top-1 {s.agree / s.count:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
