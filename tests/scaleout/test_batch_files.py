"""The batch job's file handling and its errors, without Ray."""

from __future__ import annotations

import json
import sys

import pytest

from fastdecode.errors import ConfigError
from fastdecode.scaleout.batch import check_items, key_of, read_done
from fastdecode.scaleout.ray_util import import_ray


def test_a_torn_last_line_is_cut_and_runs_again(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = [json.dumps({"index": 0, "id": "a", "text": "x"}), json.dumps({"index": 1, "text": "y"})]
    out.write_text("\n".join(whole) + '\n{"index": 2, "te')
    done = read_done(str(out))
    assert set(done) == {'id:"a"', "index:1"}
    assert out.read_text() == "\n".join(whole) + "\n"


def test_a_file_that_is_not_results_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("hello\n" + json.dumps({"index": 0, "text": "x"}) + "\n")
    with pytest.raises(ConfigError, match="not a result"):
        read_done(str(out))


def test_keys_are_ids_else_positions_and_an_id_twice_is_refused():
    assert key_of({"id": 3}, 9) != key_of({"id": "3"}, 9)
    assert check_items([{"prompt": "a"}, {"id": 1, "prompt": "b"}], "in") == ["index:0", "id:1"]
    with pytest.raises(ConfigError, match="lines 1 and 3 have the same id"):
        check_items([{"id": "x", "prompt": "a"}, {"prompt": "b"}, {"id": "x", "prompt": "c"}], "in")


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'fastdecode\[ray\]'"):
        import_ray("generate --ray")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompts-file", "in.jsonl", "--ray"], "give --prompts-file IN.jsonl and --out OUT.jsonl"),
        (["generate", "--prompt", "hi", "--out", "o.jsonl"], "give --ray"),
        (["serve", "--routing", "prefix"], "give --replicas N"),
        (["serve", "--replicas", "2", "--max-replicas", "3"], "give one of them"),
    ],
)
def test_half_given_scale_out_commands_are_one_error(argv, message, capsys, tmp_path, monkeypatch):
    from fastdecode.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_forwarded_request_always_has_text_for_the_prefix_router():
    from fastdecode.scaleout.forward import ForwardedRequest

    def text(body: bytes) -> str:
        return ForwardedRequest.from_http("POST", "/v1/chat/completions", b"", [], body).prompt

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"text": "hi"}]}]
    assert text(json.dumps({"messages": messages}).encode()) == "be briefhi"
    assert text(b'{"prompt": ["a", "b"]}') == "ab"
    for bad in (b"", b"not json", b'{"messages": []}', b'{"messages": [{"role": "user", "content": ""}]}'):
        assert text(bad) == "/v1/chat/completions"
