"""The cost of the decoding options: tokens/s with penalties and with a JSON schema, plain and
speculative, against the same without them, interleaved per prompt in one process.

    .venv/bin/python scripts/bench_decoding_options.py [--model smollm2-135m] [--weights gguf]
        [--drafter ngram] [--samples 6] [--max-new-tokens 128] [--rounds 2]

Every setting (none, penalties, json-schema, json-schema+penalties) runs plain and with the
drafter on one engine (one shared target; ``speculate=False`` for plain), each prompt in
turn through every setting, ``--rounds`` times, the order alternated each round; a warm-up
generation per setting is excluded. Checks every speculative output against plain
decoding's (token-identical, greedy). Prints decode tok/s (new tokens after the first /
the time after the first token), the ratio to the same mode without options, and tau. In plain
mode that ratio is what the logits processors cost (the grammar's masks included); in
speculative mode it adds what they change in acceptance (docs/benchmarks.md §3.3)."""

from __future__ import annotations

import argparse

from fastdecode import GrammarSpec
from fastdecode.args import EngineArgs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "summary": {"type": "string", "maxLength": 300},
    },
    "required": ["name", "year", "tags", "summary"],
    "additionalProperties": False,
}
TOPICS = ["the Eiffel Tower", "the first Moon landing", "Python, the language", "the printing press",
          "the Rosetta Stone", "the Great Wall of China", "penicillin", "the World Wide Web"]  # fmt: skip
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1)


def settings() -> dict[str, dict]:
    grammar = GrammarSpec.json_schema(SCHEMA)
    return {
        "none": {},
        "penalties": PENALTIES,
        "json-schema": {"grammar": grammar},
        "json-schema+penalties": {"grammar": grammar, **PENALTIES},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    EngineArgs.add_cli_args(p, groups=("model", "drafter"), defaults={"drafter": "ngram"})
    p.add_argument("--samples", type=int, default=6, help="prompts (of the built-in topics)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    engine = EngineArgs.from_cli_args(args).create_engine()
    prompts = [f"Describe {t} as a JSON object with a name, a year, some tags and a summary." for t in TOPICS]
    prompts = prompts[: args.samples]
    table = settings()
    modes = {"plain": False, engine.drafter_name: True}
    totals = {(s, m): [0, 0.0, 0, 0] for s in table for m in modes}  # tokens, decode s, steps, step tokens
    for options in table.values():  # warm-up: kernels, the grammar library's tokenizer
        engine.generate(prompts[0], max_new_tokens=8, **options)
    for r in range(args.rounds):
        for prompt in prompts:
            reference = {}
            order = list(table.items()) if r % 2 == 0 else list(table.items())[::-1]
            for name, options in order:
                for mode, speculate in modes.items() if r % 2 == 0 else list(modes.items())[::-1]:
                    result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, speculate=speculate, **options)
                    if speculate and name in reference and result.token_ids != reference[name]:
                        raise SystemExit(f"speculative output differs from plain decoding under {name}")
                    if not speculate:
                        reference[name] = result.token_ids
                    row = totals[(name, mode)]
                    row[0] += max(0, result.num_new_tokens - 1)
                    row[1] += result.wall_s - result.ttft_s
                    if result.acceptance is not None:
                        row[2] += result.acceptance.steps
                        row[3] += result.acceptance.step_tokens
    print(f"{'setting':24} {'mode':>10} {'tok/s':>8} {'vs none':>8} {'tau':>5}")
    for name in table:
        for mode in modes:
            tokens, decode_s, steps, step_tokens = totals[(name, mode)]
            base_tokens, base_s = totals[("none", mode)][:2]
            rate = tokens / decode_s if decode_s else 0.0
            base = base_tokens / base_s if base_s else 0.0
            tau = step_tokens / steps if steps else 1.0
            print(f"{name:24} {mode:>10} {rate:8.1f} {rate / base if base else 0:8.2f} {tau:5.2f}")


if __name__ == "__main__":
    main()
