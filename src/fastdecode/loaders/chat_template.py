"""A model's chat template rendered as transformers' ``apply_chat_template(..., tokenize=False)`` renders it.

Why hand-written: importing transformers costs a GGUF load over a second (its package ``__init__``
and dependency checks), for a template that jinja2 renders in microseconds. This copies the parts of
``transformers/utils/chat_template_utils.py`` (transformers 5) that decide the text: jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks`` and the loop controls, the
``tojson`` filter that does not escape HTML, the globals ``raise_exception``, ``strftime_now``, ``dict``
and ``namespace`` (no underscore names), messages with their None-valued keys dropped and reasoning
copied under the names templates read, and the tokenizer's named special tokens as variables.
``{% generation %}`` blocks (transformers' assistant-mask tracker) render their body. A test renders
conversations both ways.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the body, as transformers renders it without a mask."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 (the template's argument name)
    return datetime.now().strftime(format)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # jinja2's signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


@lru_cache
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_Namespace
    )
    return env.from_string(template)


def _plain(value):
    """``value`` rebuilt of plain JSON types (what the sandboxed template may see); anything else a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic messages (the server's)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message) -> dict:
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, dict):
        raise TypeError(f"chat messages should be dicts, got {message!r}")
    message = _plain({k: v for k, v in message.items() if v is not None})
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def select_template(chat_template: str | dict | None) -> str:
    """The template to render: a single one, or the "default" of named ones (transformers' choice without tools)."""
    if isinstance(chat_template, dict):
        if "default" not in chat_template:
            raise ValueError(f"the model has several chat templates and no default: {sorted(chat_template)}")
        return chat_template["default"]
    if not chat_template:
        raise ValueError("the tokenizer has no chat template")
    return chat_template


def render_chat(template: str, messages: list, add_generation_prompt: bool, special_tokens: dict[str, str]) -> str:
    """The text of ``messages`` (a list of role/content dicts) through ``template``."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    return _compile(template).render(
        messages=[_message(m) for m in messages],
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(special_tokens),
    )
