"""One request's response, built up as its sequences' outputs arrive.

A response's ``fastdecode`` object carries the speculation figures (conventions in
``fastdecode.decoding.metrics``: tau counts the bonus token, and plain decoding has tau 1).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from fastdecode.engine import RequestOutput
from fastdecode.server.engine_loop import Accepted
from fastdecode.server.logprobs import CompletionLogprobs, chat_block, merge
from fastdecode.server.metrics import FINISH_REASONS
from fastdecode.server.protocol import ParsedRequest


def choice_stats(out: RequestOutput) -> dict | None:
    """One finished sequence's figures (None for one the server aborted)."""
    result = out.result
    if result is None:
        return None
    a = result.acceptance
    return {
        "drafter": result.drafter,
        "drafted_tokens": a.drafted_tokens if a else 0,
        "accepted_tokens": a.accepted_tokens if a else 0,
        "acceptance_rate": a.alpha if a else 0.0,
        "tau": a.tau if a else 1.0,
        "per_position_acceptance": a.per_position_acceptance if a else [],
        "ttft_s": result.ttft_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "cached_prompt_tokens": result.num_cached_prompt_tokens,
    }


@dataclass
class Delta:
    """What one output adds to its choice: the text to send (an echoed prompt first) and its logprobs object."""

    index: int
    text: str
    logprobs: dict | None


class ResponseBuilder:
    """What one request's sequences have produced so far: text, finish reasons, token counts, figures."""

    def __init__(self, parsed: ParsedRequest, accepted: Accepted, model_name: str, replica: str | None = None) -> None:
        self.parsed = parsed
        self.model_name = model_name
        self.replica = replica
        self.index = {request_id: i for i, request_id in enumerate(accepted.request_ids)}
        self.grant = accepted.grant  # max_tokens as the server's limits granted it (fastdecode.server.limits)
        self.num_prompt_tokens = accepted.num_prompt_tokens
        n = len(accepted.request_ids)
        self.text = [""] * n
        self.finish = [None] * n
        self.completion_tokens = [0] * n
        self.finals: list[RequestOutput | None] = [None] * n
        self.logprobs: list[dict | None] = [None] * n  # each choice's logprobs object so far
        self._logprobs = [CompletionLogprobs() for _ in range(n)]
        self.echo = [""] * n  # completions with echo: each choice's prompt text
        self._echoed = [False] * n
        self.logprob_sum = [0.0] * n  # best_of's ranking: each sequence's summed token log-probabilities
        self.id = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    @property
    def unfinished(self) -> list[str]:
        return [rid for rid, i in self.index.items() if self.finish[i] is None]

    def add(self, out: RequestOutput) -> Delta:
        """Take one output; what it adds to its choice."""
        i = self.index[out.request_id]
        echo = self._echo(i)
        self.text[i] += out.text
        self.completion_tokens[i] += len(out.token_ids)
        if out.finished:
            self.finish[i] = FINISH_REASONS.get(out.finish_reason, "stop")
            self.finals[i] = out
            if out.result is not None:
                self.text[i] = out.result.text
        self.logprob_sum[i] += sum(e.logprob for e in out.logprobs or ())
        logprobs = self._add_logprobs(i, out, echo)
        return Delta(i, echo + out.text, logprobs)

    def _echo(self, i: int) -> str:
        """The prompt's text, the first time choice i is seen with echo (else "")."""
        if not self.parsed.echo or self._echoed[i]:
            return ""
        self._echoed[i] = True
        prompt = self.parsed.prompts[self.parsed.prompt_index[i]]
        self.echo[i] = (
            prompt if isinstance(prompt, str) else self.parsed.echo_texts.get(self.parsed.prompt_index[i], "")
        )
        return self.echo[i]

    def _add_logprobs(self, i: int, out: RequestOutput, echo: str) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        entries = list(out.logprobs or [])
        if self.parsed.chat:
            block = chat_block(entries)
            self.logprobs[i] = {"content": (self.logprobs[i] or {"content": []})["content"] + block["content"]}
            return block
        if out.prompt_logprobs:
            entries = [*out.prompt_logprobs, *entries]
        elif echo:
            self._logprobs[i].skip(echo)
        block = self._logprobs[i].block(entries)
        self.logprobs[i] = merge(self.logprobs[i], block)
        return block

    def usage(self) -> dict:
        seen, prompt_tokens = set(), 0
        for i, p in enumerate(self.parsed.prompt_index):
            if p not in seen:
                seen.add(p)
                prompt_tokens += self.num_prompt_tokens[i]
        completion = sum(self.completion_tokens)
        cached = sum(f.result.num_cached_prompt_tokens for f in self.finals if f is not None and f.result is not None)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def figures(self) -> dict:
        """The request's speculation figures, summed over its sequences."""
        stats = [f.result.acceptance for f in self.finals if f is not None and f.result is not None]
        with_drafter = [a for a in stats if a is not None]
        drafted = sum(a.drafted_tokens for a in with_drafter)
        accepted = sum(a.accepted_tokens for a in with_drafter)
        steps = sum(a.steps for a in with_drafter)
        drafter = next((f.result.drafter for f in self.finals if f is not None and f.result is not None), "none")
        replica = {"replica": self.replica} if self.replica is not None else {}
        clamped = self.grant.clamped() if self.grant is not None else None
        return {
            **replica,
            **({"clamped": clamped} if clamped else {}),
            "drafter": drafter if with_drafter else "none",
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tau": sum(a.step_tokens for a in with_drafter) / steps if steps else 1.0,
        }

    def headers(self) -> dict[str, str]:
        """The response's own headers: ``X-Fastdecode-Clamped`` when a limit clamped max_tokens."""
        return self.grant.header() if self.grant is not None else {}

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def body(self) -> dict:
        """The whole (non-streamed) response."""
        choices = []
        for i in range(len(self.text)):
            choice = {"index": i, "finish_reason": self.finish[i], "logprobs": self._final_logprobs(i)}
            if self.parsed.chat:
                choice["message"] = {"role": "assistant", "content": self.text[i]}
            else:
                choice["text"] = self.echo[i] + self.text[i]
            choice["fastdecode"] = choice_stats(self.finals[i]) if self.finals[i] is not None else None
            choices.append(choice)
        obj = "chat.completion" if self.parsed.chat else "text_completion"
        if self.parsed.best_of > self.parsed.n:
            choices = self._best(choices)
        return {**self.head(obj), "choices": choices, "usage": self.usage(), "fastdecode": self.figures()}

    def _best(self, choices: list[dict]) -> list[dict]:
        """best_of: per prompt, the n sequences with the highest log-probability per token, best first
        (usage still counts every sequence's tokens, as OpenAI bills them)."""
        best_of, kept = self.parsed.best_of, []
        for start in range(0, len(choices), best_of):
            group = range(start, start + best_of)
            ranked = sorted(group, key=lambda i: -self.logprob_sum[i] / max(1, self.completion_tokens[i]))
            kept += [choices[i] for i in ranked[: self.parsed.n]]
        return [{**choice, "index": k} for k, choice in enumerate(kept)]

    def _final_logprobs(self, i: int) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        empty = {"content": []} if self.parsed.chat else CompletionLogprobs().block([])
        return self.logprobs[i] or empty
