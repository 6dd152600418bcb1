"""Runners: fastdecode's engine and the peers it is measured against, behind one interface.

A runner turns ``(prompt, seed)`` into a :class:`GenerationResult` under one
configuration. Every runner tokenizes through the same ``Engine.encode`` (chat
template included), counts the tokenization in its wall time, and stops at the
same EOS ids and token limit, so wall times compare under identical conditions
and greedy token ids compare one to one.

Peers (the ``PEERS`` registry, one entry each; a missing package or setting skips a peer
with a note, never fails the run):

* ``hf`` - transformers ``model.generate``, plain decoding;
* ``hf-prompt-lookup`` - the same with ``prompt_lookup_num_tokens=K``;
* ``hf-assisted`` - the same with ``assistant_model`` (needs ``--draft-model``);
* ``llama-cpp`` / ``llama-cpp-prompt-lookup`` - llama-cpp-python on the model's
  GGUF file, plain and with ``LlamaPromptLookupDecoding``. Its weights stay
  quantized where transformers dequantizes them, so its tokens may differ.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from fastdecode.bench.config import BenchConfig, ModelCache, build_engine, generation_config, model_label
from fastdecode.decoding.metrics import GenerationResult
from fastdecode.engine import Engine
from fastdecode.registry import Registry


class Runner(Protocol):
    target_name: str  # what computes the logits: "native", "hf", "transformers generate", "llama.cpp"

    def generate(self, prompt: str, seed: int, max_new_tokens: int | None = None) -> GenerationResult: ...


class EngineRunner:
    """fastdecode itself: ``Engine.generate``."""

    def __init__(self, engine: Engine, chat: bool | None) -> None:
        self.engine, self.chat = engine, chat
        self.target_name = engine.target.name
        self.float_kernel = engine.target.float_kernel

    def generate(self, prompt: str, seed: int, max_new_tokens: int | None = None) -> GenerationResult:
        options = {"seed": seed} if max_new_tokens is None else {"seed": seed, "max_new_tokens": max_new_tokens}
        result = self.engine.generate(prompt, chat=self.chat, **options)
        self.engine.free_kv_cache()  # a sweep holds dozens of engines
        return result

    def snapshot(self):
        """What the engine's drafter has learned across requests (None if it learns nothing)."""
        drafter = self.engine.drafter
        return copy.deepcopy(drafter) if getattr(drafter, "cross_request_state", False) else None

    def restore(self, snapshot) -> None:
        """Back to a :meth:`snapshot`: the drafter forgets what later requests taught it."""
        if snapshot is not None:
            self.engine.drafter = copy.deepcopy(snapshot)  # this runner's own engine; every request forks it


def plain_engine(cfg: BenchConfig, cache: ModelCache) -> Engine:
    """The baseline engine of ``cfg``'s model: a peer borrows its tokenization and EOS ids."""
    return build_engine(dataclasses.replace(cfg, peer=None, peer_options={}, drafter="none", drafter_options={}), cache)


def _budget(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> int:
    """The engine's own limit: max_new_tokens, or what is left of the context."""
    return max(1, min(max_new_tokens, engine.target.context_length - len(prompt_ids)))


def _result(name: str, prompt_ids, new_ids, eos_ids, limit, t_start, t_first, t_end) -> GenerationResult:
    t_first = t_end if t_first is None else t_first
    decode_s = t_end - t_first
    n = len(new_ids)
    finish = "eos" if new_ids and new_ids[-1] in eos_ids else ("length" if n >= limit else "context")
    return GenerationResult(
        token_ids=list(new_ids),
        text="",
        num_prompt_tokens=len(prompt_ids),
        num_new_tokens=n,
        ttft_s=t_first - t_start,
        decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        wall_s=t_end - t_start,
        finish_reason=finish,
        drafter=name,
        acceptance=None,
    )


class _FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.t_first: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


class HFGenerateRunner:
    """transformers ``model.generate`` with extra keyword arguments (prompt lookup, assistant model)."""

    def __init__(self, cfg: BenchConfig, cache: ModelCache, extra: dict) -> None:
        self.cfg, self.extra = cfg, extra
        self.engine = plain_engine(cfg, cache)
        self.config = generation_config(cfg)
        self.name = cfg.peer
        self.target_name = "transformers generate"

    def generate(self, prompt: str, seed: int, max_new_tokens: int | None = None) -> GenerationResult:
        from transformers import GenerationConfig as HFGenerationConfig
        from transformers.utils import logging as hf_logging

        engine, sampling = self.engine, self.config.sampling
        eos = sorted(engine.eos_token_ids)
        t_start = time.perf_counter()
        prompt_ids = engine.encode(prompt, self.cfg.chat)
        limit = _budget(engine, prompt_ids, max_new_tokens or self.config.max_new_tokens)
        options = dict(max_new_tokens=limit, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
        if sampling.greedy:
            options.update(do_sample=False)
        else:
            options.update(
                do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p
            )
            torch.manual_seed(seed)
        ids = torch.tensor([prompt_ids], device=engine.target.device)
        clock = _FirstTokenClock()
        previous = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # generate warns about every default it overrides
        try:
            with torch.inference_mode():
                out = engine.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=HFGenerationConfig(**options),
                    streamer=clock,
                    **self.extra,
                )
        finally:
            hf_logging.set_verbosity(previous)
        t_end = time.perf_counter()
        new_ids = out[0, len(prompt_ids) :].tolist()
        result = _result(self.name, prompt_ids, new_ids, engine.eos_token_ids, limit, t_start, clock.t_first, t_end)
        result.text = engine.tokenizer.decode(new_ids, skip_special_tokens=True)
        return result


LOGITS_ALL_BYTES = 2 << 30  # llama.cpp's logits buffer when every position's logits are kept


class LlamaCppRunner:
    """llama-cpp-python on the GGUF file the model was loaded from."""

    def __init__(self, cfg: BenchConfig, cache: ModelCache, prompt_lookup: bool) -> None:
        from llama_cpp import Llama

        from fastdecode.loading import resolve_spec

        self.cfg, self.name = cfg, cfg.peer
        self.target_name = "llama.cpp"
        self.engine = plain_engine(cfg, cache)
        self.config = generation_config(cfg)
        draft = None
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=cfg.peer_options.get("k", 10))
        # logits_all only where prompt-lookup verification needs every position's logits: otherwise
        # llama.cpp would run its LM head over every prompt token and copy each step's full
        # vocabulary row to Python (measured: 91 tok/s decoding and 214 tok/s prefill with it on
        # the embedded model, against ~127 tok/s decoding in a process of its own without it).
        # With logits_all llama.cpp allocates n_ctx x vocabulary floats up front (Gemma 3: 32,768 x
        # 262,144 = 32 GiB), so the context is bounded to what LOGITS_ALL_BYTES holds; a longer
        # prompt then fails for this peer alone, with a note.
        n_ctx = self.engine.target.context_length
        if prompt_lookup:
            n_ctx = min(n_ctx, max(512, LOGITS_ALL_BYTES // (4 * self.engine.target.vocab_size)))
        self.llm = Llama(
            model_path=resolve_spec(cfg.model).location,
            n_ctx=n_ctx,
            logits_all=prompt_lookup,
            n_threads=torch.get_num_threads(),
            draft_model=draft,
            verbose=False,
        )

    def generate(self, prompt: str, seed: int, max_new_tokens: int | None = None) -> GenerationResult:
        engine, sampling = self.engine, self.config.sampling
        t_start = time.perf_counter()
        prompt_ids = engine.encode(prompt, self.cfg.chat)
        limit = _budget(engine, prompt_ids, max_new_tokens or self.config.max_new_tokens)
        self.llm.set_seed(seed)
        new_ids, t_first = [], None
        for tok in self.llm.generate(
            prompt_ids,
            temp=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        ):
            if t_first is None:
                t_first = time.perf_counter()
            new_ids.append(int(tok))
            if tok in engine.eos_token_ids or len(new_ids) >= limit:
                break
        t_end = time.perf_counter()
        result = _result(self.name, prompt_ids, new_ids, engine.eos_token_ids, limit, t_start, t_first, t_end)
        result.text = engine.tokenizer.decode(new_ids, skip_special_tokens=True)
        return result


@dataclass(frozen=True)
class Peer:
    name: str
    label: Callable[[BenchConfig], str]  # the configuration's name in tables
    unavailable: Callable[[BenchConfig], str | None]  # why this peer cannot run here, or None
    build: Callable[[BenchConfig, ModelCache], Runner]


def _missing(module: str, package: str) -> Callable[[BenchConfig], str | None]:
    def check(cfg: BenchConfig) -> str | None:
        return None if importlib.util.find_spec(module) else f"{package} is not installed"

    return check


def _needs_draft_model(cfg: BenchConfig) -> str | None:
    return None if cfg.draft_model else "no draft model configured (--draft-model)"


def _llama_cpp_unavailable(cfg: BenchConfig) -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    from fastdecode.errors import FastDecodeError
    from fastdecode.loading import resolve_spec

    with contextlib.suppress(FastDecodeError):
        if resolve_spec(cfg.model).kind == "gguf":
            return None
    return f"{cfg.model} is not a GGUF model"


def _hf_assisted(cfg: BenchConfig, cache: ModelCache) -> Runner:
    assistant, _ = cache.get(cfg.draft_model, cfg.dtype, cfg.device)
    return HFGenerateRunner(
        cfg, cache, {"assistant_model": assistant, "num_assistant_tokens": cfg.peer_options.get("k", 5)}
    )


PEERS: Registry[str, Peer] = Registry("peer")
for _peer in (
    Peer(
        "hf",
        lambda c: "hf generate",
        _missing("transformers", "transformers"),
        lambda c, cache: HFGenerateRunner(c, cache, {}),
    ),
    Peer(
        "hf-prompt-lookup",
        lambda c: f"hf prompt-lookup K={c.peer_options['k']}",
        _missing("transformers", "transformers"),
        lambda c, cache: HFGenerateRunner(c, cache, {"prompt_lookup_num_tokens": c.peer_options["k"]}),
    ),
    Peer(
        "hf-assisted",
        lambda c: (
            f"hf assisted K={c.peer_options['k']}" + (f" ({model_label(c.draft_model)})" if c.draft_model else "")
        ),
        _needs_draft_model,
        _hf_assisted,
    ),
    Peer(
        "llama-cpp",
        lambda c: "llama.cpp",
        _llama_cpp_unavailable,
        lambda c, cache: LlamaCppRunner(c, cache, prompt_lookup=False),
    ),
    Peer(
        "llama-cpp-prompt-lookup",
        lambda c: f"llama.cpp prompt-lookup K={c.peer_options['k']}",
        _llama_cpp_unavailable,
        lambda c, cache: LlamaCppRunner(c, cache, prompt_lookup=True),
    ),
):
    PEERS.register(_peer.name)(_peer)

# What --peers accepts: "llama-cpp" runs both llama.cpp variants.
PEER_CHOICES: dict[str, tuple[str, ...]] = {
    "hf": ("hf",),
    "hf-prompt-lookup": ("hf-prompt-lookup",),
    "hf-assisted": ("hf-assisted",),
    "llama-cpp": ("llama-cpp", "llama-cpp-prompt-lookup"),
}


def build_runner(cfg: BenchConfig, cache: ModelCache) -> Runner:
    if cfg.peer is None:
        return EngineRunner(build_engine(cfg, cache), cfg.chat)
    return PEERS.get(cfg.peer).build(cfg, cache)
