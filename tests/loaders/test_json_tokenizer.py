"""A GGUF's tokenizer read back without transformers (``JsonTokenizer``) answers as transformers'
``TokenizersBackend`` of the same file: encode, decode, chat template, vocabulary, special ids; built
from the file and read back from the cache. The embedded model's, and others where installed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fastdecode.errors import ModelLoadError
from fastdecode.kernels.build import cache_root
from fastdecode.loaders.gguf_file import GGUFFile
from fastdecode.loaders.gguf_tokenizer import gguf_tokenizer
from fastdecode.loaders.json_tokenizer import JsonTokenizer
from fastdecode.loading import BUILTIN_MODELS

pytestmark = pytest.mark.integration  # the embedded model's file

TEXTS = [
    "",
    "Hello world",
    "  leading, trailing and   inner   runs of spaces  ",
    "tabs\tand\nnew\n\nlines\r\n and \u00a0 no-break",
    "def f(x):\n\treturn x  # ünïcödé 日本語 한국어 emoji 🦙🎉 and a combining e\u0301",
    "<|im_start|>user\nhi<|im_end|> <s></s><bos><eos><start_of_turn> special tokens in text",
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nx<|eot_id|>",
    "numbers 1234567890 3.14159 -42 and punctuation !?.,;:'\"()[]{} don't I'm we've",
    "\u200b zero width, \U0001f600 astral, \x00 nul and \x7f del",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? ünï 日本"},
    ],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "  spaced  "}],
]


def _gemma3() -> Path:
    try:
        return BUILTIN_MODELS["gemma3-270m"].locate()
    except ModelLoadError:
        pytest.skip("optional model gemma3-270m not installed")


def _llama3() -> Path:
    path = Path("/work/gguf/llama-3.2-1b-q4_k_m-seed0.gguf")
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    return path


FILES = {"smollm2": lambda: BUILTIN_MODELS["smollm2-135m"].locate(), "gemma3": _gemma3, "llama3": _llama3}


@pytest.fixture(scope="module", params=sorted(FILES))
def tokenizers(request, tmp_path_factory):
    """(built, cached, theirs): ours from the file, ours read back, transformers' TokenizersBackend."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    path = Path(FILES[request.param]())
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path_factory.mktemp("cache")))
    gguf = GGUFFile(path)
    built, cached = gguf_tokenizer(str(path), gguf), gguf_tokenizer(str(path), gguf)
    monkeypatch.undo()
    theirs = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return built, cached, theirs


def test_both_are_json_tokenizers_over_a_saved_entry(tokenizers):
    built, cached, theirs = tokenizers
    assert type(built) is JsonTokenizer and type(cached) is JsonTokenizer
    for tok in (built, cached):  # transformers' own object, on demand, of the same class
        assert type(tok.transformers_tokenizer()) is type(theirs)


def test_encode(tokenizers):
    *ours, theirs = tokenizers
    for tok in ours:
        for text in TEXTS:
            for special in (True, False):
                assert (
                    tok(text, add_special_tokens=special)["input_ids"]
                    == theirs(text, add_special_tokens=special)["input_ids"]
                ), (text, special)
            assert tok(text)["input_ids"] == theirs(text)["input_ids"]


def test_decode_random_ids(tokenizers):
    *ours, theirs = tokenizers
    rng = random.Random(0)
    n = len(theirs)
    specials = list(theirs.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(n) for _ in range(rng.randrange(0, 12))]
        ids += rng.sample(specials, min(len(specials), rng.randrange(0, 3)))
        rng.shuffle(ids)
        for skip in (False, True):
            expected = theirs.decode(ids, skip_special_tokens=skip)
            for tok in ours:
                assert tok.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)
    for tok in ours:
        assert tok.batch_decode([[i] for i in range(50)]) == theirs.batch_decode([[i] for i in range(50)])
        assert tok.decode(7) == theirs.decode(7)


def test_chat_template(tokenizers):
    *ours, theirs = tokenizers
    if not theirs.chat_template:
        assert all(not tok.chat_template for tok in ours)
        return
    for chat in CHATS:
        for prompt in (True, False):
            try:
                expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            except Exception as exc:  # the template's own refusal (roles that must alternate, ...)
                for tok in ours:
                    with pytest.raises(type(exc)):
                        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
                continue
            for tok in ours:
                assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == expected
                ids = theirs.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
                assert tok.apply_chat_template(chat, add_generation_prompt=prompt) == list(ids)


def test_vocabulary_and_special_ids(tokenizers):
    *ours, theirs = tokenizers
    ids = list(range(0, len(theirs), max(1, len(theirs) // 997))) + list(theirs.all_special_ids)
    for tok in ours:
        assert tok.get_vocab() == theirs.get_vocab()
        assert (len(tok), tok.vocab_size) == (len(theirs), theirs.vocab_size)
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
            assert getattr(tok, name) == getattr(theirs, name), name
        assert tok.special_tokens_map == theirs.special_tokens_map
        assert tok.clean_up_tokenization_spaces == bool(theirs.clean_up_tokenization_spaces) or tok.decode(ids) == (
            theirs.decode(ids)
        )
        for skip in (False, True):
            assert tok.convert_ids_to_tokens(ids, skip_special_tokens=skip) == theirs.convert_ids_to_tokens(
                ids, skip_special_tokens=skip
            )
        assert tok.convert_ids_to_tokens(5) == theirs.convert_ids_to_tokens(5)


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    path = BUILTIN_MODELS["smollm2-135m"].locate()
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    gguf = GGUFFile(path)
    first = gguf_tokenizer(str(path), gguf)
    (saved,) = (tmp_path / "tokenizers").iterdir()
    (saved / "tokenizer.json").write_text("{not json")
    again = gguf_tokenizer(str(path), gguf)
    assert again("Hello world")["input_ids"] == first("Hello world")["input_ids"]
    assert JsonTokenizer.load(saved)("Hello world")["input_ids"] == first("Hello world")["input_ids"]


_CHILD = """
import json, sys
from fastdecode.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))))
"""


def test_a_gguf_load_that_finds_its_tokenizer_cached_imports_no_transformers(tmp_path, child_process_env):
    """From the start of loading to the generated text, chat template included: the first load builds
    the tokenizer with transformers; the next reads it back and imports no transformers module at all."""
    kernels = cache_root() / "kernels"  # the built kernels shared, the tokenizers' cache new
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels, target_is_directory=True)
    env = dict(child_process_env, FASTDECODE_CACHE=str(tmp_path))
    args = ["generate", "--model", "smollm2-135m", "--max-new-tokens", "6", "--json", "--prompt", "Hi, who are you?"]
    outputs = []
    for _ in ("built", "cached"):
        run = subprocess.run([sys.executable, "-c", _CHILD, *args], env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        *_, result, modules = run.stdout.strip().splitlines()
        outputs.append((json.loads(result), json.loads(modules)))
    (built, imported_built), (cached, imported_cached) = outputs
    assert "transformers" in imported_built  # the conversion of the vocabulary is transformers' job
    assert imported_cached == []
    assert built["num_prompt_tokens"] > 10  # the chat template's header and turn markers around the prompt
    assert (cached["token_ids"], cached["text"]) == (built["token_ids"], built["text"])


@pytest.mark.parametrize("cache", ["on", "off"])
def test_what_needs_transformers_own_tokenizer_gets_it(tmp_path, monkeypatch, cache):
    """``save_pretrained`` (compress, export) and llguidance's view (structured output): through
    transformers' tokenizer of the same files, read back from the cache or kept from the build."""
    from transformers import AutoTokenizer

    from fastdecode.decoding.structured import ll_tokenizer

    path = BUILTIN_MODELS["smollm2-135m"].locate()
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    if cache == "off":
        monkeypatch.setenv("FASTDECODE_NO_CACHE", "1")
    tok = gguf_tokenizer(str(path), GGUFFile(path))
    tok = JsonTokenizer.load(next((tmp_path / "cache" / "tokenizers").iterdir())) if cache == "on" else tok
    tok.save_pretrained(tmp_path / "saved")
    saved = AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    for text in TEXTS:
        assert saved(text)["input_ids"] == tok(text)["input_ids"]
    assert saved.apply_chat_template(CHATS[1], tokenize=False) == tok.apply_chat_template(CHATS[1], tokenize=False)
    pytest.importorskip("llguidance")
    ll = ll_tokenizer(tok, len(tok), [tok.eos_token_id])
    assert ll.vocab_size >= len(tok)
    assert ll.tokenize_str("Hello world") == tok("Hello world", add_special_tokens=False)["input_ids"]
