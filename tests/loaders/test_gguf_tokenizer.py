"""A GGUF's tokenizer is cached by its content (loaders/gguf_tokenizer.py): files sharing a tokenizer
share one entry, read back without transformers; a file whose tokenizer differs by one token gets its
own; what the new build makes is what transformers' ``TokenizersBackend.from_pretrained`` makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import finish_gguf

from fastdecode.errors import ModelLoadError
from fastdecode.loaders.gguf_file import GGUFFile
from fastdecode.loaders.gguf_tokenizer import _build, gguf_tokenizer, tokenizer_digest
from fastdecode.loaders.json_tokenizer import settings_of

TEXTS = ["", "t1t2 w5 w7", "<s>a b</s> c!~", "w12w3 t1", "no w in here: xyz ..."]


def _write(path, name: str = "tiny", renamed: dict[int, str] | None = None, tensor_seed: int | None = None):
    """A byte-level BPE tokenizer's GGUF (tests/gguf_files.write_tokenizer_gguf's vocabulary of 150),
    ``general.name`` ``name``, token i spelled ``renamed[i]``, and one float tensor of seed ``tensor_seed``."""
    import numpy as np
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = ["<unk>", "<s>", "</s>", *[chr(c) for c in range(33, 127)], "t1", "t2"]
    tokens += [f"w{i}" for i in range(150 - len(tokens))]
    for i, token in (renamed or {}).items():
        tokens[i] = token
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, *[1] * (len(tokens) - 3)])
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if tensor_seed is not None:
        writer.add_tensor("x.weight", np.random.default_rng(tensor_seed).standard_normal((4, 32), dtype=np.float32))
    finish_gguf(writer)
    return str(path)


def _transformers(path: str):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    folder, name = os.path.split(path)
    return TokenizersBackend.from_pretrained(folder, gguf_file=name, local_files_only=True)


def _entries(cache) -> list:
    return sorted(p.name for p in (cache / "tokenizers").iterdir())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTDECODE_NO_CACHE", raising=False)
    return tmp_path / "cache"


def test_the_key_is_the_tokenizer_not_the_file(tmp_path):
    a = GGUFFile(_write(tmp_path / "a.gguf", tensor_seed=0))
    b = GGUFFile(_write(tmp_path / "b.gguf", name="another", tensor_seed=1))  # other name, other weights
    c = GGUFFile(_write(tmp_path / "c.gguf", renamed={120: "zz"}, tensor_seed=0))  # one token respelled
    assert os.path.getsize(a.path) == os.path.getsize(b.path)
    assert tokenizer_digest(a) == tokenizer_digest(b)
    assert tokenizer_digest(a) != tokenizer_digest(c)


def test_a_file_sharing_a_cached_tokenizer_builds_nothing(tmp_path, cache, child_process_env):
    """The second file's load, in a fresh process, finds the first's entry: no transformers module."""
    a = _write(tmp_path / "a.gguf", tensor_seed=0)
    b = _write(tmp_path / "copies" / "b.gguf", name="another", tensor_seed=1)
    built = gguf_tokenizer(a, GGUFFile(a))
    child = (
        "import json, sys\n"
        "from fastdecode.loaders.gguf_file import GGUFFile\n"
        "from fastdecode.loaders.gguf_tokenizer import gguf_tokenizer\n"
        f"tok = gguf_tokenizer({b!r}, GGUFFile({b!r}))\n"
        f"ids = [tok(t)['input_ids'] for t in {TEXTS!r}]\n"
        "print(json.dumps([ids, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')]))\n"
    )
    env = dict(child_process_env, FASTDECODE_CACHE=str(cache))
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    ids, imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == []
    assert ids == [built(t)["input_ids"] for t in TEXTS]
    assert len(_entries(cache)) == 1


def test_a_tokenizer_one_token_apart_gets_its_own_entry(tmp_path, cache):
    a = _write(tmp_path / "a.gguf")
    c = _write(tmp_path / "c.gguf", renamed={120: "zz"})
    tok_a = gguf_tokenizer(a, GGUFFile(a))
    tok_c = gguf_tokenizer(c, GGUFFile(c))
    assert len(_entries(cache)) == 2
    assert "zz" in tok_c.get_vocab() and "zz" not in tok_a.get_vocab()
    assert tok_c.get_vocab() == _transformers(c).get_vocab()
    again = gguf_tokenizer(c, GGUFFile(c))  # read back from its own entry
    for text in [*TEXTS, "zz w1 zz"]:
        assert again(text)["input_ids"] == tok_c(text)["input_ids"] == _transformers(c)(text)["input_ids"]


def test_a_file_rewritten_in_place_with_another_tokenizer_is_not_served_a_stale_one(tmp_path, cache):
    path = _write(tmp_path / "m.gguf")
    first = gguf_tokenizer(path, GGUFFile(path))
    stat = os.stat(path)
    _write(tmp_path / "m.gguf", renamed={120: "zz"})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the content says
    second = gguf_tokenizer(path, GGUFFile(path))
    assert "zz" in second.get_vocab() and "zz" not in first.get_vocab()


def _sentencepiece(path) -> str:
    """A sentencepiece ("llama") vocabulary: no merges (recovered from the scores), no add_bos flag."""
    from gguf import GGUFWriter

    pieces = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581abc"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0, 0.0, 0.0, *(-float(i) for i in range(len(pieces) - 3))])
    writer.add_token_types([2, 3, 3, *[1] * (len(pieces) - 3)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    finish_gguf(writer)
    return str(path)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_the_build_is_transformers_from_pretrained(tmp_path, kind):
    path = _write(tmp_path / "t.gguf") if kind == "byte-level" else _sentencepiece(tmp_path / "t.gguf")
    ours, theirs = _build(path, GGUFFile(path)), _transformers(path)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert settings_of(ours) == settings_of(theirs)
    assert (ours.add_bos_token, ours.add_eos_token) == (theirs.add_bos_token, theirs.add_eos_token)
    for text in [*TEXTS, "abc abcab ba"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]


def test_nothing_beside_the_file_is_read(tmp_path, cache):
    """``from_pretrained`` on the file's folder would take a tokenizer.json lying there over the file's
    own vocabulary; the entry is keyed by the file's content, so the build reads that content only."""
    path = _write(tmp_path / "t.gguf")
    expected = _transformers(path)(TEXTS[1])["input_ids"]
    other = _transformers(_write(tmp_path / "other" / "o.gguf", renamed={120: "zz"}))
    other.save_pretrained(tmp_path)  # a stranger's tokenizer.json and tokenizer_config.json beside t.gguf
    assert gguf_tokenizer(path, GGUFFile(path))(TEXTS[1])["input_ids"] == expected


def test_a_vocabulary_that_is_not_utf8_is_one_clear_error(tmp_path, cache):
    path = _write(tmp_path / "t.gguf", renamed={120: "\u00e9"})
    length = (2).to_bytes(8, "little")  # the token's length, then é: c3 a9; c3 ff is no UTF-8
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw.replace(length + b"\xc3\xa9", length + b"\xc3\xff"))
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        gguf_tokenizer(path, GGUFFile(path))
