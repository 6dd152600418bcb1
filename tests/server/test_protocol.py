"""Request bodies -> checked requests (fastdecode.server.protocol), without a server."""

import pytest

from fastdecode.server.protocol import MAX_SEQUENCES, APIError, parse, read_json


def test_completion_defaults_and_options():
    req = parse({"prompt": "hi", "max_tokens": 5, "temperature": 0, "top_k": 3, "stop": "\n"}, False, 99)
    assert req.prompts == ["hi"] and not req.chat and req.n == 1 and not req.stream
    assert req.options == [
        {
            "max_new_tokens": 5,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 3,
            "stop": ("\n",),
            "speculate": True,
            "seed": None,
        }
    ]
    # No max_tokens: the server's default; no temperature: OpenAI's default 1.0.
    req = parse({"prompt": [1, 2, 3]}, False, 99)
    assert req.prompts == [[1, 2, 3]]
    assert req.options[0]["max_new_tokens"] == 99 and req.options[0]["temperature"] == 1.0


def test_kv_policy_is_a_per_request_option_only_when_given():
    assert parse({"prompt": "hi", "kv_policy": "sinks:4,500"}, False, 8).options[0]["kv_policy"] == "sinks:4,500"
    assert "kv_policy" not in parse({"prompt": "hi"}, False, 8).options[0]  # the server's default


def test_n_and_several_prompts_give_one_sequence_each_with_seed_plus_i():
    req = parse({"prompt": ["a", "b"], "n": 3, "seed": 10}, False, 8)
    assert req.prompt_index == [0, 0, 0, 1, 1, 1]
    assert [o["seed"] for o in req.options] == [10, 11, 12, 10, 11, 12]


def test_chat_messages_roles_and_text_parts():
    body = {
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
        ],
        "max_tokens": 4,
        "max_completion_tokens": 7,
        "speculate": False,
    }
    req = parse(body, True, 99)
    assert req.prompts == [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "ok"},
        ]
    ]
    assert req.options[0]["max_new_tokens"] == 7  # max_completion_tokens wins
    assert req.options[0]["speculate"] is False


def test_stream_options():
    req = parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, False, 8)
    assert req.stream and req.include_usage


def test_harmless_unsupported_fields_are_accepted():
    parse(
        {
            "prompt": "x",
            "logprobs": None,
            "echo": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "user": "u",
            "metadata": {"a": 1},
        },
        False,
        8,
    )


@pytest.mark.parametrize("raw", [b"", b"  ", b"{", b"[1]", b'"x"', b'{"prompt": NaN}', b"\xff\xfe"])
def test_read_json_refuses(raw):
    with pytest.raises(APIError) as info:
        read_json(raw)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "body, chat, param",
    [
        ({"prompt": "x", "temperature": "0.5"}, False, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, False, "temperature"),
        ({"prompt": "x", "temperature": -1}, False, "temperature"),
        ({"prompt": "x", "top_p": 0}, False, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
        ({"prompt": "x", "max_tokens": 1.5}, False, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, False, "max_tokens"),
        ({"prompt": "x", "n": 0}, False, "n"),
        ({"prompt": ["x"] * 2, "n": MAX_SEQUENCES}, False, "n"),
        ({"prompt": "x", "seed": -1}, False, "seed"),
        ({"prompt": "x", "stop": ["a", ""]}, False, "stop"),
        ({"prompt": "x", "stop": 3}, False, "stop"),
        ({"prompt": "x", "stream": "yes"}, False, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options"),
        ({"prompt": "x", "logprobs": 21}, False, "logprobs"),
        ({"prompt": "x", "logprobs": True}, False, "logprobs"),
        ({"prompt": "x", "suffix": "end"}, False, "suffix"),
        ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, True, "top_logprobs"),
        ({"prompt": "x", "n": 3, "best_of": 2}, False, "best_of"),
        ({"prompt": "x", "best_of": 40, "n": 2, "stream": True}, False, "best_of"),
        ({"prompt": ["x", "y"], "best_of": 40}, False, "n"),
        ({"messages": [{"role": "user", "content": "a"}], "echo": True}, True, "echo"),
        ({"messages": [{"role": "user", "content": "a"}], "best_of": 2}, True, "best_of"),
        ({"prompt": "x", "speculate": "no"}, False, "speculate"),
        ({"prompt": "x", "kv_policy": "lru"}, False, "kv_policy"),
        ({"prompt": "x", "kv_policy": 3}, False, "kv_policy"),
        ({"prompt": ""}, False, "prompt"),
        ({"prompt": []}, False, "prompt"),
        ({"prompt": [1, "a"]}, False, "prompt"),
        ({"prompt": [1, -2]}, False, "prompt"),
        ({}, False, "prompt"),
        ({"messages": []}, True, "messages"),
        ({"messages": "hi"}, True, "messages"),
        ({}, True, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, True, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}, True, "messages[1].role"),
        ({"messages": [{"role": "user", "content": None}]}, True, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages[0].content"),
        ({"messages": ["hi"]}, True, "messages[0]"),
        ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, True, "tools"),
    ],
)
def test_bad_fields_are_400_naming_the_param(body, chat, param):
    with pytest.raises(APIError) as info:
        parse(body, chat, 8)
    assert info.value.status == 400
    assert info.value.param == param
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
