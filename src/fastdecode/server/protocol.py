"""The OpenAI request bodies the server accepts, checked into one typed :class:`ParsedRequest`.

Every problem with a body is an :class:`APIError` with OpenAI's error fields
(``message``, ``type``, ``param``, ``code``) and an HTTP status, raised before
anything reaches the engine. Types are strict (``"1"`` is not a number, ``true``
is not an integer); fields fastdecode does not implement are refused when they
ask for something (``logprobs: true``) and ignored when they hold their default.

Extensions to OpenAI's fields: ``top_k`` (0 or -1: off), ``speculate``
(false: this request decodes plainly even when the server has a drafter) and ``kv_policy``
(``full``, ``sinks[:S[,W]]``, ``h2o[:BUDGET[,RECENT[,SINKS[,EVICT]]]]``: ``fastdecode.kv.policy``; default the server's).
With ``n`` > 1 and a ``seed``, choice i samples with seed ``seed + i``: the
choices differ, and each is reproducible on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fastdecode.decoding.logits_process import bias_entries
from fastdecode.decoding.structured import GrammarSpec
from fastdecode.decoding.tokenization import EMPTY_PROMPT, check_text
from fastdecode.errors import ConfigError
from fastdecode.server.limits import DEFAULT_MAX_N

MAX_SEQUENCES = DEFAULT_MAX_N  # prompts x n in one request (the server's default --max-n)
MAX_JSON_DEPTH = 64  # nesting levels of a request body (a JSON schema in response_format is the deepest field)
MAX_STOP_STRINGS = 16
SEED_LIMIT = 2**63  # the engine's seeds are non-negative 63-bit integers
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

MAX_LOGPROBS = 20  # logprobs (completions) and top_logprobs (chat): OpenAI's limit

# Fields fastdecode does not implement -> the values that ask for nothing (accepted and ignored).
UNSUPPORTED = {
    "suffix": (None, ""),
    "echo": (None, False),  # completions declare echo and best_of; chat has neither
    "best_of": (None, 1),
    "tools": (None, []),
    "functions": (None, []),
    "audio": (None,),
    "prediction": (None,),
    # vLLM's sampling extensions that would change the output: refused rather than ignored
    "stop_token_ids": (None, []),
    "ignore_eos": (None, False),
    "min_p": (None, 0),
    "include_stop_str_in_output": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


class APIError(Exception):
    """An error response in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)  # at most the server's --max-n (parse)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculate: bool | None = None
    # logits processors (fastdecode.decoding.logits_process); repetition_penalty and min_tokens are vLLM's extensions
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    response_format: dict | None = None
    kv_policy: str | None = None


class CompletionBody(_Common):
    prompt: Any = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-N per token
    echo: bool | None = None  # the prompt before the completion (with its log-probabilities if logprobs is set)
    best_of: int | None = Field(None, ge=1)


class ChatBody(_Common):
    messages: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass
class ParsedRequest:
    """One request, checked. ``prompts``: raw text or token ids (completions) or one
    message list (chat); sequence i uses ``prompts[prompt_index[i]]`` with ``options[i]``."""

    chat: bool
    model: str | None
    prompts: list  # completions: str | list[int]; chat: list[{"role", "content"}]
    n: int
    stream: bool
    include_usage: bool
    options: list[dict] = field(default_factory=list)  # Engine.add_request keywords, one per sequence
    prompt_index: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-N per generated token (None: no logprobs object)
    echo: bool = False  # completions: the prompt (and its log-probabilities) before each choice's text
    best_of: int = 1  # sequences decoded per prompt (completions' best_of; n of them are returned)
    echo_texts: dict[int, str] = field(default_factory=dict)  # token-id prompts' text, decoded on the engine thread


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def read_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400: not JSON, nested deeper than ``MAX_JSON_DEPTH``, or
    holding a string that is not UTF-8 text (JSON's lone surrogate escapes, ``"\\ud800"``)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty: expected a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:  # the C parser's own limit (~1,000 levels), met before ours is measured
        raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    check_values(body)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def check_values(body) -> None:
    """Walk the body once, without recursion: every container within ``MAX_JSON_DEPTH`` levels,
    every string (and key) UTF-8 text, one rule for every field (``prompt``, ``messages``,
    ``stop``, a grammar, ...), checked before any field is read."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                check_text(value, path)
            except ConfigError as exc:
                raise APIError(400, str(exc), param=path.split("[", 1)[0].split(".", 1)[0]) from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, f"{path}.{key}" if path else key, depth))  # the key itself, as text
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
                else:
                    stack.append((item, f"{path}[{key}]", depth + 1))


def _validate(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = str(error["loc"][0]) if error["loc"] else None
        value = body.get(param) if param else None
        raise APIError(400, f"{param}: {error['msg']} (got {json.dumps(value)[:80]})", param=param) from None


def _asks_nothing(value, harmless) -> bool:
    if harmless is None:
        return value is None
    return value is not None and isinstance(value, bool) == isinstance(harmless, bool) and value == harmless


def _kv_policy(text: str) -> str:
    from fastdecode.errors import ConfigError
    from fastdecode.kv.policy import KVPolicy

    try:
        KVPolicy.parse(text)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="kv_policy") from None
    return text


def _check_unsupported(extra: dict) -> None:
    for name, value in extra.items():
        harmless = UNSUPPORTED.get(name)
        if harmless is not None and not any(_asks_nothing(value, h) for h in harmless):
            raise APIError(400, f"{name} is not supported by fastdecode", param=name, code="unsupported_parameter")


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    what = "prompt must be a non-empty string, a list of token ids, or a list of either"
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or p == [] or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(400, what, param="prompt")
    if any(
        p in ("", []) for p in prompts
    ):  # the engine's wording (fastdecode.decoding.tokenization), one rule everywhere
        raise APIError(400, EMPTY_PROMPT, param="prompt")
    if any(t < 0 for p in prompts if isinstance(p, list) for t in p):
        raise APIError(400, "token ids must be >= 0", param="prompt")
    return prompts


def _chat_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise APIError(
                400,
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}",
                param=f"{where}.role",
            )
        content = message.get("content")
        if (
            isinstance(content, list)
            and content
            and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
        ):
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        out.append({"role": CHAT_ROLES[role], "content": content})
    return out


def parse(body: dict, chat: bool, default_max_tokens: int, max_n: int = MAX_SEQUENCES) -> ParsedRequest:
    """A checked request from a JSON object (``chat``: /v1/chat/completions, else /v1/completions);
    ``max_n``: the most sequences it may ask for (n, best_of, prompts x best_of: ``--max-n``)."""
    if chat:
        req = _validate(ChatBody, body)
        if req.messages is None:
            raise APIError(400, "messages is required", param="messages")
        prompts: list = [_chat_messages(req.messages)]
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        req = _validate(CompletionBody, body)
        if req.prompt is None:
            raise APIError(400, "prompt is required", param="prompt")
        prompts = _completion_prompts(req.prompt)
        max_tokens = req.max_tokens
    _check_unsupported(req.model_extra or {})
    n = req.n or 1
    for name, value in (("n", req.n), ("best_of", getattr(req, "best_of", None))):
        if value is not None and value > max_n:
            raise APIError(400, f"{name} must be at most {max_n} (this server's --max-n), got {value}", param=name)
    best_of = n if chat else _best_of(req, n)
    if not chat and req.response_format is not None:
        raise APIError(400, "response_format is for /v1/chat/completions", param="response_format")
    if len(prompts) * best_of > max_n:
        what = f"n={n}" if best_of == n else f"best_of={best_of}"
        raise APIError(
            400, f"{len(prompts)} prompt(s) x {what} is more than {max_n} sequences (this server's --max-n)", param="n"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise APIError(400, f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    base = {
        "max_new_tokens": max_tokens or default_max_tokens,
        "temperature": 1.0 if req.temperature is None else float(req.temperature),  # OpenAI's default
        "top_p": 1.0 if req.top_p is None else float(req.top_p),
        "top_k": max(0, req.top_k or 0),
        "stop": tuple(stop),
        "speculate": True if req.speculate is None else req.speculate,
    }
    base.update(processing_options(req))
    if req.kv_policy is not None:
        base["kv_policy"] = _kv_policy(req.kv_policy)
    parsed = ParsedRequest(
        chat=chat,
        model=req.model,
        prompts=prompts,
        n=n,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=_logprobs(req, chat),
        echo=not chat and bool(req.echo),
        best_of=best_of,
    )
    if parsed.logprobs is not None or best_of > n:  # best_of ranks by the tokens' log-probabilities
        base["logprobs"] = parsed.logprobs or 0
        if parsed.echo and parsed.logprobs is not None:
            base["prompt_logprobs"] = parsed.logprobs
    for p in range(len(prompts)):
        for i in range(best_of):
            seed = None if req.seed is None else (req.seed + i) % SEED_LIMIT
            parsed.options.append({**base, "seed": seed})
            parsed.prompt_index.append(p)
    return parsed


def _best_of(req, n: int) -> int:
    """Sequences per prompt: ``best_of`` (>= n; the n with the highest log-probability per token are returned)."""
    best_of = req.best_of or n
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if best_of > n and req.stream:
        raise APIError(400, "best_of > n cannot be streamed (the best are known only at the end)", param="best_of")
    return best_of


def _logprobs(req, chat: bool) -> int | None:
    """Top-N per generated token, or None: completions' ``logprobs: N``; chat's ``logprobs: true``
    with ``top_logprobs: N`` (0 by default)."""
    if not chat:
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def processing_options(req) -> dict:
    """The logits processors' ``Engine.add_request`` keywords (only those the request sets)."""
    out: dict = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            out[name] = float(value)
    if req.min_tokens:
        out["min_tokens"] = req.min_tokens
    if req.logit_bias:
        try:
            out["logit_bias"] = bias_entries(req.logit_bias)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="logit_bias") from None
    grammar = response_grammar(req.response_format)
    if grammar is not None:
        out["grammar"] = grammar
    return out


def response_grammar(response_format: dict | None) -> GrammarSpec | None:
    """``response_format``'s grammar: OpenAI's ``text``, ``json_object`` and ``json_schema``
    (``{"json_schema": {"name", "schema", "strict"}}``), and fastdecode's ``regex``
    (``{"type": "regex", "regex": ...}``) and ``grammar`` (``{"type": "grammar", "grammar": <Lark>}``)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return GrammarSpec.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ConfigError('json_schema must be an object with a "schema" object')
            return GrammarSpec.json_schema(spec.get("schema", {}))
        if kind in ("regex", "grammar") and isinstance(response_format.get(kind), str):
            return GrammarSpec("regex" if kind == "regex" else "lark", response_format[kind])
        if kind in ("regex", "grammar"):
            raise ConfigError(f'a {kind} response_format needs "{kind}": a string')
    except ConfigError as exc:
        raise APIError(400, f"response_format: {exc}", param="response_format") from None
    raise APIError(
        400,
        f"response_format type must be text, json_object, json_schema, regex or grammar, got {json.dumps(kind)[:40]}",
        param="response_format",
    )
