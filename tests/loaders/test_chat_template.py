"""The chat template environment against transformers' own (``render_jinja_template``), on a
template that uses what transformers adds to jinja2: its globals, filters and extensions."""

from __future__ import annotations

import pytest

from fastdecode.loaders.chat_template import render_chat

# The template environment itself, on a template that uses what transformers' environment adds.
_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif -%}
{%- if loop.index > 3 %}{% break %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
<{{ m.role }}>{% generation %}{{ m.content | trim }}{% endgeneration %}{{ m | tojson }}{{ dict(a=1) | tojson(indent=1) }}
{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}]{% endif %}
{%- endfor -%}
{{ ns.n }}{{ bos_token }}{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.mark.parametrize("prompt", [True, False])
def test_render_is_transformers_render(prompt):
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    chat = [
        {"role": "user", "content": " <b>&'\"</b> 日本 ", "tool_calls": None},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    (theirs,), _ = render_jinja_template(
        [_normalize_chat_messages(chat)], chat_template=_TEMPLATE, add_generation_prompt=prompt, **special
    )
    assert render_chat(_TEMPLATE, chat, prompt, special) == theirs
    with pytest.raises(Exception, match="no bad roles"):
        render_chat(_TEMPLATE, [{"role": "bad", "content": "x"}], prompt, special)
    with pytest.raises(Exception, match="namespace"):
        render_chat("{% set ns = namespace(_x=1) %}", chat, prompt, special)
