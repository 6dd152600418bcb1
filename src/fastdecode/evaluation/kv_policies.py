"""Perplexity under KV policies over a text several times the window (StreamingLLM's evaluation).

One text of ``num_tokens`` tokens (default: the WikiText-2 raw test split) is scored five
ways with a cache of ``window`` slots (a reduced window makes "4x the window" affordable;
positions stay within it, so the model is never asked past what it was trained on):

- ``full``: the full cache *within* the window - sliding windows of ``window`` tokens
  recomputed every ``window / 2`` tokens (``fastdecode.evaluation.quality.windows``), so each token
  sees between half a window and a window of context: the quality a policy aims to keep;
- ``sinks``: the text streamed once through a cache of 4 sink tokens and the most recent
  ``window - 4`` (``fastdecode.kv.policy`` ``sinks``);
- ``window``: the same without sinks (``sinks:0``), the paper's window attention;
- ``h2o:0.2``, ``h2o:0.5``: H2O with a budget of 20% and 50% of the window.

Every mode predicts the same positions (1 .. num_tokens - 1). A policy mode runs the very
code the engine runs for a request (``kv.policy.make_room`` before each pass, rows at slots,
``KVState.accept`` after), on one sequence, with no engine around it: :class:`PolicySequence`.

    python -m fastdecode.evaluation.kv_policies --model smollm2-135m --window 512 --tokens 2048
    python -m fastdecode.evaluation.kv_policies ... --text src/fastdecode/data/tinyshakespeare/calibration.txt

(``--text FILE``: any other text, e.g. the shipped Tiny Shakespeare, so that a policy's figures
are checked on a text its rule was not chosen on.)

Measured so (SmolLM2-135M, float weights, the first 2,048 tokens of WikiText-2 test, 4x a
512-slot window, one run; docs/benchmarks.md 11b): full 25.72, sinks 23.55 (0.92x: every token
sees ~508 tokens where the recomputed windows give 256..512), window without sinks 41.05
(1.60x), H2O 20% 29.03 (1.13x) and 50% 24.10 (0.94x) with a kept set per layer and KV head
(one set for every layer and head gave 37.71, 1.47x, and 26.12); weighing each attention by the
token's value norm (VATP), H2O 20% 28.80 (1.12x).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fastdecode.backends.base import BatchEntry, Executor
from fastdecode.errors import ConfigError
from fastdecode.evaluation.quality import score_windows, tokenize, windows
from fastdecode.kv.cache import BlockTable
from fastdecode.kv.policy import KVPolicy, make_room

DEFAULT_MODES = ("full", "sinks", "window", "h2o:0.2", "h2o:0.5")
CHUNK_TOKENS = 64


class PolicySequence:
    """One sequence fed in order on ``target`` under a KV policy with a cache of ``window`` slots
    (the policy's context length): what the engine does for one request, without the engine."""

    def __init__(self, target: Executor, policy: KVPolicy | str, window: int, block_size: int = 16) -> None:
        self.target, self.window = target, window
        self.state = KVPolicy.parse(policy).new_state(window, block_size)
        self.cache = target.new_kv_cache(-(-window // block_size) + 1, block_size, enable_prefix_caching=False)
        self.table = BlockTable()
        self.num_computed = 0  # context positions fed

    @torch.inference_mode()
    def feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens``; the logits of every row, [len(tokens), vocab] (cut into passes at full caches)."""
        out, i = [], 0
        while i < len(tokens):
            state = self.state
            if state is not None:
                make_room(self.target, self.cache, self.table, state, self.num_computed)
            room = state.room() if state is not None else self.window - self.num_computed
            if room <= 0:
                raise ConfigError(f"the full cache holds {self.window} positions: use a policy to go past it")
            n = min(room, len(tokens) - i)
            slot = state.slot(self.num_computed) if state is not None else self.num_computed
            pool = self.cache.pool
            self.table.blocks.extend(pool.allocate(max(0, pool.blocks_for(slot + n) - len(self.table.blocks))))
            attention = None
            if state is not None:
                state.pending_start, state.pending = self.num_computed, []
                attention = state.pending if state.wants_attention else None
            entry = BatchEntry(list(tokens[i : i + n]), slot, list(self.table.blocks), n, attention=attention)
            out.append(self.target.forward_batch(self.cache, [entry]))
            self.num_computed += n
            if state is not None:
                state.accept(self.num_computed)
            i += n
        return torch.cat(out)


@dataclass
class PolicyPerplexity:
    mode: str
    perplexity: float
    tokens_scored: int
    window: int


def stream_nll(target: Executor, ids: Sequence[int], policy: str, window: int, chunk: int = CHUNK_TOKENS):
    """(sum of NLL, count) of positions 1 .. len(ids) - 1, the text streamed once under ``policy``."""
    seq = PolicySequence(target, policy, window)
    nll, count = 0.0, 0
    for a in range(0, len(ids) - 1, chunk):
        b = min(a + chunk, len(ids) - 1)  # rows a .. b - 1 predict positions a + 1 .. b
        logp = torch.log_softmax(seq.feed(ids[a:b]).float(), dim=-1)
        labels = torch.as_tensor(ids[a + 1 : b + 1])
        nll -= float(logp.gather(1, labels[:, None]).double().sum())
        count += b - a
    return nll, count


def iter_policies(
    target: Executor, ids: Sequence[int], window: int, modes: Sequence[str] = DEFAULT_MODES
) -> Iterator[PolicyPerplexity]:
    """Each mode's perplexity, as it is measured."""
    for mode in modes:
        if mode == "full":
            scores = score_windows(target, ids, windows(len(ids), window, max(1, window // 2)))
            nll, count = scores.nll, scores.count
        else:
            nll, count = stream_nll(target, ids, "sinks:0" if mode == "window" else mode, window)
        yield PolicyPerplexity(mode, math.exp(nll / count), count, window)


def evaluate_policies(
    target: Executor, ids: Sequence[int], window: int, modes: Sequence[str] = DEFAULT_MODES
) -> list[PolicyPerplexity]:
    return list(iter_policies(target, ids, window, modes))


def split_modes(text: str) -> list[str]:
    """Modes from a comma list whose policies may hold commas: ``"full,h2o:0.2,0.5,4,1,sinks"``
    is full, ``h2o:0.2,0.5,4,1`` and sinks (a piece that starts with a digit continues the last)."""
    modes: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if modes and piece[:1].isdigit():
            modes[-1] += "," + piece
        else:
            modes.append(piece)
    return modes


def main(argv: Sequence[str] | None = None) -> int:
    from fastdecode.args import EngineArgs
    from fastdecode.data.corpora import evaluation_text
    from fastdecode.util.files import text_file

    parser = argparse.ArgumentParser(
        prog="python -m fastdecode.evaluation.kv_policies", description=__doc__.split("\n\n")[0]
    )
    EngineArgs.add_cli_args(parser, groups=("model",))
    parser.add_argument("--window", type=int, default=512, help="cache slots (a reduced context; default 512)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of text scored (default 2048: 4x 512)")
    parser.add_argument(
        "--modes", default=",".join(DEFAULT_MODES), help="comma list; a policy may hold commas (default: %(default)s)"
    )
    parser.add_argument(
        "--text",
        type=text_file,
        default=None,
        metavar="FILE",
        help="score this UTF-8 text instead of the built-in one (the WikiText-2 raw test split); e.g. the shipped "
        "src/fastdecode/data/tinyshakespeare/calibration.txt",
    )
    args = parser.parse_args(argv)
    try:
        engine_args = EngineArgs.from_cli_args(args)
        model, tokenizer = engine_args.load_model()
        target = engine_args.create_target(model, tokenizer)
        if not 2 <= args.window <= target.context_length:
            raise ConfigError(f"--window must be in 2..{target.context_length}, got {args.window}")
        ids = tokenize(tokenizer, evaluation_text() if args.text is None else args.text.text)[: args.tokens]
        modes = split_modes(args.modes)
        for mode in modes:  # checked before the first is run
            if mode not in ("full", "window"):
                KVPolicy.parse(mode).new_state(args.window, 16)
        source = "WikiText-2 test" if args.text is None else args.text.path
        print(
            f"{len(ids)} tokens, window {args.window} ({len(ids) / args.window:.1f}x), model {args.model}, text {source}"
        )
        print(f"{'mode':<10} {'perplexity':>10} {'vs full':>8}", flush=True)
        base = None
        for r in iter_policies(target, ids, args.window, modes):  # each line as soon as it is measured
            base = r.perplexity if r.mode == "full" else base
            ratio = f"{r.perplexity / base:8.3f}" if base else ""
            print(f"{r.mode:<10} {r.perplexity:10.3f} {ratio}", flush=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
