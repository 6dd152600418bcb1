"""Output processing: appending verified tokens, stopping, and what each request reports.

``emit`` appends a step's tokens one by one and stops exactly where plain decoding
would: at an end-of-sequence token, a stop string (the detokenizer holds back text
that could be one), ``max_new_tokens`` or the model's context length. A step's
``RequestOutput`` carries the tokens taken and the text released; a finished
request's ``GenerationResult`` its tokens, text and timings.

The front ends (``generate``, ``stream``) read a request's outputs from its *outbox*,
a queue opened for that request while a consumer follows it (vLLM's output collector).
"""

from __future__ import annotations

from collections import deque

from fastdecode.decoding.metrics import GenerationResult
from fastdecode.engine.request import Request, RequestOutput


def eos_ids(model, tokenizer) -> frozenset[int]:
    """Every end-of-sequence id the model's generation config, its config and the tokenizer name."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class OutputProcessor:
    """Emits tokens, decides when a request stops, builds its outputs and results, and
    keeps the outboxes of the requests a front end follows."""

    def __init__(self, eos_token_ids: frozenset[int], context_length: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        self.outbox: dict[str, deque[RequestOutput]] = {}

    def emit(self, request: Request, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping exactly at EOS, a stop string or a limit;
        returns the tokens taken."""
        config = request.config
        taken = []
        for tok in tokens:
            request.context.append(tok)
            request.new_tokens.append(tok)
            taken.append(tok)
            reason = None
            if tok in self.eos_token_ids:
                reason = "eos"
            elif request.detokenizer.add([tok]) and config.stop:
                reason = "stop"
            elif len(request.new_tokens) >= config.max_new_tokens:
                reason = "length"
            elif request.kv is None and len(request.context) >= self.context_length:  # a KV policy evicts instead
                reason = "context"
            if reason:
                request.finish_reason = reason
                break
        return taken

    def output(self, request: Request, taken: list[int], num_drafted: int, num_accepted: int) -> RequestOutput:
        final = request.finish_reason is not None
        config = request.config
        return RequestOutput(
            request.request_id,
            taken,
            request.detokenizer.release(final),
            final,
            request.finish_reason,
            num_drafted,
            num_accepted,
            logprobs=request.logprobs[len(request.logprobs) - len(taken) :] if config.logprobs is not None else None,
            prompt_logprobs=(
                request.prompt_logprobs
                if config.prompt_logprobs is not None and len(request.new_tokens) == len(taken)
                else None
            ),
        )

    def result(self, request: Request) -> GenerationResult:
        """A finished request's result (``t_end`` set)."""
        t_first = request.t_first if request.t_first is not None else request.t_end
        decode_s = request.t_end - t_first
        n = len(request.new_tokens)
        return GenerationResult(
            token_ids=list(request.new_tokens),
            text=request.detokenizer.text,
            num_prompt_tokens=len(request.prompt_ids),
            num_new_tokens=n,
            ttft_s=t_first - request.t_arrival,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            wall_s=request.t_end - request.t_arrival,
            finish_reason=request.finish_reason,
            drafter=request.drafter_name,
            acceptance=request.stats,
            num_cached_prompt_tokens=request.num_cached_tokens,
            decode_passes=request.decode_passes,
            decode_pass_s=request.decode_pass_s,
            draft_s=request.draft_s,
            logprobs=list(request.logprobs) if request.config.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.config.prompt_logprobs is not None else None,
        )

    def aborted(self, request: Request) -> None:
        """Tell a request's consumer, if one follows it, that it was stopped outside a step."""
        if request.request_id in self.outbox:
            self.outbox[request.request_id].append(
                RequestOutput(
                    request.request_id,
                    [],
                    request.detokenizer.release(True),
                    True,
                    request.finish_reason,
                    result=request.result,
                )
            )

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Queue a step's outputs for the requests a consumer follows."""
        for out in outputs:
            if out.request_id in self.outbox:
                self.outbox[out.request_id].append(out)
