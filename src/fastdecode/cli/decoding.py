"""``fastdecode generate``'s decoding options: the logits processors, a JSON schema, logprobs.

Each flag maps onto one field of ``ProcessingParams`` or ``GenerationConfig``
(``fastdecode.decoding.logits_process``, ``fastdecode.decoding.structured``); a bad value is one
``ConfigError`` naming the flag.
"""

from __future__ import annotations

import argparse
import json

from fastdecode.errors import ConfigError


def add_decoding_args(parser) -> None:
    g = parser.add_argument_group("decoding options (logits processors, structured output, logprobs)")
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract penalty x count of each generated token (OpenAI's; [-2, 2])",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract penalty from every token generated once (OpenAI's; [-2, 2])",
    )
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="CTRL's penalty on prompt and generated tokens (1 = off)"
    )
    g.add_argument(
        "--logit-bias", help='token id -> bias in [-100, 100]: JSON ({"50256": -100}) or a list (50256:-100,13:2.5)'
    )
    g.add_argument("--min-tokens", type=int, default=0, help="forbid end-of-sequence before this many new tokens")
    g.add_argument(
        "--json-schema", metavar="FILE", help="constrain the output to JSON matching this schema (a JSON file)"
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="report each new token's log-probability and its N most likely alternatives (--json)",
    )


def parse_logit_bias(text: str | None) -> dict[int, float]:
    """``--logit-bias``: a JSON object, or ``id:bias`` pairs separated by commas."""
    if not text:
        return {}
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--logit-bias is not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ConfigError("--logit-bias must be a JSON object of token id -> bias")
        return value
    out = {}
    for item in text.split(","):
        key, sep, bias = item.partition(":")
        try:
            if not sep:
                raise ValueError
            out[int(key)] = float(bias)
        except ValueError:
            raise ConfigError(f"--logit-bias takes id:bias pairs (50256:-100,13:2.5), got {item.strip()!r}") from None
    return out


def read_json_schema(path: str | None):
    """``--json-schema FILE``: the grammar, or None."""
    if path is None:
        return None
    from fastdecode.decoding.structured import GrammarSpec

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"--json-schema: cannot read {path}: {exc.strerror}") from None
    return GrammarSpec.json_schema(text)


def decoding_options(args: argparse.Namespace) -> dict:
    """``GenerationConfig`` fields from the flags: ``processing`` and ``logprobs``."""
    from fastdecode.decoding.logits_process import ProcessingParams

    processing = ProcessingParams(
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=parse_logit_bias(args.logit_bias),
        min_tokens=args.min_tokens,
        grammar=read_json_schema(args.json_schema),
    )
    return {"processing": processing, "logprobs": args.logprobs}


def logprobs_lines(result) -> list[str]:
    """Each new token's log-probability (and alternatives) as text lines, for stderr."""
    lines = []
    for e in result.logprobs or ():
        alternatives = "  ".join(f"{t!r} {v:.3f}" for _, t, v in e.top)
        lines.append(f"{e.token!r:>16} {e.logprob:8.3f}" + (f"   [{alternatives}]" if alternatives else ""))
    return lines
