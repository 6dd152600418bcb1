"""Incremental detokenization: the text always equals decoding every new token at
once, whatever the chunking; stop strings cut exactly and are held back while
unresolved; and the work per token does not grow with the length of the output.

The contract that matters is checked on the embedded model's own tokenizer
(SmolLM2, byte-level BPE) with text whose characters span several tokens, and
on random token ids (invalid UTF-8, special tokens). A Llama-style SentencePiece
decoder (leading-space strip, byte fallback) and decoders that rewrite across
token boundaries (clean_up_tokenization_spaces) check the context and fallbacks.
"""

from __future__ import annotations

import random

import pytest

import fastdecode.decoding.detokenize as detokenize
from fastdecode.decoding.detokenize import MAX_PENDING_TOKENS, IncrementalDetokenizer, find_stop, stop_prefix_len

SAMPLE = (
    "Héllo wörld! 🎉 Ça va? 你好，世界。  Two  spaces,\n\tand a tab. "
    "Emoji family: 👨‍👩‍👧 flags 🇫🇷 math ∑∫ √2 ≈ 1.414; naïve café résumé. "
    "日本語のテキスト とスペース. Ünïcödé ç ø å ß. The end 🙂\n\n"
)


# --- tokenizers -------------------------------------------------------------------


class CountingTokenizer:
    """Passes everything through to ``inner``, recording how many ids each decode call got."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.decoded.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def llama_style_tokenizer():
    """A SentencePiece-style tokenizer as Llama 2 ships it: "▁" for a space, byte
    fallback for other characters, and the leading space of the text stripped."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pieces = ["▁", "▁the", "the", "▁a", "a", "b", "▁b", ".", "▁.", ",", "'", "n", "t", "▁n", "é", "▁é"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({p: 259 + i for i, p in enumerate(pieces)})
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    inner.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    inner.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )

    class Adapter:
        all_special_ids = [0, 1, 2]
        vocab_size = len(vocab)

        def decode(self, ids, skip_special_tokens: bool = False) -> str:
            return inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    return Adapter()


CLEANUPS = [
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
]  # transformers' clean_up_tokenization


@pytest.fixture
def cleanup_tokenizer(tokenizer):
    """The character tokenizer with transformers' clean-up of spaces before punctuation."""

    class Cleanup(type(tokenizer)):
        clean_up_tokenization_spaces = True

        def decode(self, ids, skip_special_tokens: bool = False) -> str:
            text = super().decode(ids, skip_special_tokens)
            for old, new in CLEANUPS:
                text = text.replace(old, new)
            return text

    return Cleanup()


# --- helpers ----------------------------------------------------------------------


def chunked(ids, sizes):
    i = 0
    for size in sizes:
        if i >= len(ids):
            return
        yield ids[i : i + size]
        i += size
    if i < len(ids):
        yield ids[i:]


def random_sizes(seed: int, max_size: int = 9):
    rng = random.Random(seed)
    while True:
        yield rng.randint(1, max_size)


def run(tokenizer, ids, sizes, stop=(), check_each_step=True):
    """Add ``ids`` in chunks; return the detokenizer and the list of releases."""
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    releases, seen = [], []
    for chunk in chunked(ids, sizes):
        seen.extend(chunk)
        hit = detok.add(chunk)
        if check_each_step and not stop:
            assert detok.text == tokenizer.decode(seen, skip_special_tokens=True)
        releases.append(detok.release(final=False))
        if hit:
            break
    releases.append(detok.release(final=True))
    return detok, releases


CHUNKINGS = {
    "one-at-a-time": lambda: iter(lambda: 1, 0),
    "random": lambda: random_sizes(0),
    "all-at-once": lambda: [10**9],
}


# --- pure functions ---------------------------------------------------------------


def test_find_stop_earliest_start_wins():
    assert find_stop("say hello world", ("world", "lo w")) == 7
    assert find_stop("say hello", ("world",)) == -1
    assert find_stop("abc", ()) == -1


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("hello wo", ("world",), 2),
        ("hello wo", ("world", "o wor"), 4),
        ("hello world", ("world",), 0),  # a whole stop string is not a proper prefix
        ("ab", ("abc",), 2),
        ("b", ("abc",), 0),
        ("", ("abc",), 0),
    ],
)
def test_stop_prefix_len(text, stop, expected):
    assert stop_prefix_len(text, stop) == expected


# --- text equals the full decode --------------------------------------------------


@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_character_tokenizer_text_equals_decode(tokenizer, chunking):
    ids = tokenizer("  It's a test, isn't it? Yes!", add_special_tokens=False)["input_ids"]
    detok, releases = run(tokenizer, ids, CHUNKINGS[chunking]())
    assert detok.text == "  It's a test, isn't it? Yes!"
    assert "".join(releases) == detok.text


@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_smollm2_multibyte_text_equals_decode(smollm2_tokenizer, chunking):
    ids = smollm2_tokenizer(SAMPLE, add_special_tokens=False)["input_ids"]
    # the sample must exercise characters split over tokens
    assert any(smollm2_tokenizer.decode([t]).endswith("\ufffd") for t in ids)
    detok, releases = run(smollm2_tokenizer, ids, CHUNKINGS[chunking]())
    assert detok.text == SAMPLE == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(releases) == detok.text
    assert all("\ufffd" not in r for r in releases)


@pytest.mark.parametrize("seed", [1, 2])
def test_smollm2_random_ids_text_equals_decode(smollm2_tokenizer, seed):
    """Random ids: invalid UTF-8 (lone continuation bytes, cut-off sequences) and
    special tokens mid-stream, which decode skips."""
    rng = random.Random(seed)
    vocab = len(smollm2_tokenizer)
    byte_tokens = [t for t in range(vocab) if smollm2_tokenizer.decode([t]) == "\ufffd"][:200]
    ids = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(500)]
    ids[100:110] = smollm2_tokenizer.all_special_ids * 3 + [ids[100]]
    detok, releases = run(smollm2_tokenizer, ids, random_sizes(seed, 5))
    assert detok.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(releases) == detok.text


def test_smollm2_incomplete_character_is_held_back(smollm2_tokenizer):
    ids = smollm2_tokenizer(" 🎉!", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 3  # " " + emoji over several byte tokens + "!"
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids=[1, 2, 3])
    detok.add(ids[:2])
    assert detok.text.endswith("\ufffd")
    assert "\ufffd" not in detok.release(final=False)
    detok.add(ids[2:])
    assert detok.release(final=False).endswith("🎉!")
    assert detok.text == " 🎉!"


def llama_ids(tok, seed: int, stray_bytes: bool) -> list[int]:
    """Random pieces, special tokens, and "€" / "🙂" as byte-fallback runs of 3 and 4
    tokens; with ``stray_bytes``, also single random bytes (mostly invalid UTF-8)."""
    rng = random.Random(seed)
    euro, smile = [3 + b for b in "€".encode()], [3 + b for b in "🙂".encode()]
    ids: list[int] = []
    while len(ids) < 400:
        r = rng.random()
        if r < 0.1:
            ids += euro
        elif r < 0.2:
            ids += smile
        elif r < 0.3 and stray_bytes:
            ids.append(3 + rng.randrange(256))
        elif r < 0.35:
            ids.append(rng.randrange(3))  # <unk>, <s>, </s>
        else:
            ids.append(rng.randrange(259, tok.vocab_size))
    return ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_llama_style_leading_space_and_byte_fallback(seed):
    """Window decodes strip a leading space the full decode keeps; the shared
    prefix cancels it."""
    tok = llama_style_tokenizer()
    ids = llama_ids(tok, seed, stray_bytes=False)
    detok, releases = run(tok, ids, random_sizes(seed, 4))
    assert detok.text == tok.decode(ids, skip_special_tokens=True)
    assert "".join(releases) == detok.text
    starts_with_space = [259 + 1, 259 + 4]  # "▁the", "a": the full decode strips only the first space
    detok, _ = run(tok, starts_with_space, iter(lambda: 1, 0))
    assert detok.text == "thea"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_llama_style_stray_bytes_keep_text_exact(seed):
    """Byte fallback decodes a run of byte tokens together, one U+FFFD per byte if
    the run is invalid UTF-8, so a stray byte can rewrite a committed "€": the
    window no longer extends its prefix, and the text is decoded whole again.
    ``text`` stays exact (the stream cannot take back text it released)."""
    tok = llama_style_tokenizer()
    ids = llama_ids(tok, seed, stray_bytes=True)
    detok, _ = run(tok, ids, random_sizes(seed, 4))
    assert detok.text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_tokenizer_that_cleans_up_spaces_is_decoded_whole(cleanup_tokenizer, chunking):
    text = "I do n't know , is n't it ? We 're here . Yes !"
    ids = cleanup_tokenizer(text, add_special_tokens=False)["input_ids"]
    detok, releases = run(cleanup_tokenizer, ids, CHUNKINGS[chunking]())
    assert detok.text == cleanup_tokenizer.decode(ids) == "I don't know, isn't it? We're here. Yes!"


def test_undeclared_rewriting_decoder_is_detected(tokenizer):
    """A decoder that rewrites across tokens without saying so: the window decode
    stops extending the prefix decode, and the detokenizer falls back to whole decodes."""

    class Rewriting(type(tokenizer)):
        def decode(self, ids, skip_special_tokens: bool = False) -> str:
            return super().decode(ids, skip_special_tokens).replace(" .", ".")

    tok = Rewriting()
    ids = tok("a . b . c", add_special_tokens=False)["input_ids"]
    detok, _ = run(tok, ids, iter(lambda: 1, 0))
    assert detok.text == "a. b. c"


# --- stop strings -----------------------------------------------------------------


def test_stop_string_spanning_steps_cuts_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("world",))
    hits = [detok.add([t]) for t in tokenizer("hello world!", add_special_tokens=False)["input_ids"][:11]]
    assert hits == [False] * 10 + [True]  # found on the step that completes it
    assert detok.stop_hit and detok.text == "hello "
    assert detok.add(tokenizer("more", add_special_tokens=False)["input_ids"]) is True
    assert detok.text == "hello "


def test_earliest_stop_string_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("world", "lo w"))
    assert detok.add(tokenizer("say hello world", add_special_tokens=False)["input_ids"])
    assert detok.text == "say hel"
    assert detok.release(final=True) == "say hel"


def test_possible_stop_prefix_is_held_back_until_resolved(tokenizer):
    def ids(s):
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    detok = IncrementalDetokenizer(tokenizer, stop=("world", "||"))
    detok.add(ids("hello wor"))
    assert detok.release(final=False) == "hello "
    detok.add(ids("k|"))
    assert detok.release(final=False) == "work"  # "wor" resolved; "|" may begin "||"
    detok.add(ids("x"))
    assert detok.release(final=False) == "|x"
    detok.add(ids(" wo"))
    assert detok.release(final=True) == " wo"  # final releases what was held
    assert detok.text == "hello work|x wo"


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_random_chunking_matches_reference(tokenizer, seed):
    """Against a brute-force reference: after each chunk, decode everything and
    cut at the earliest stop string, stopping at the first chunk that has one."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c|") for _ in range(300))
    stop = tuple({"".join(rng.choice("ab c|") for _ in range(rng.randint(1, 5))) for _ in range(2)})
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sizes = [size for size, _ in zip(random_sizes(seed, 6), ids)]
    detok, releases = run(tokenizer, ids, sizes, stop=stop)

    expected, seen = None, []
    for chunk in chunked(ids, sizes):
        seen.extend(chunk)
        decoded = tokenizer.decode(seen)
        if find_stop(decoded, stop) >= 0:
            expected = decoded[: find_stop(decoded, stop)]
            break
    assert detok.stop_hit == (expected is not None)
    assert detok.text == (expected if expected is not None else text)
    assert "".join(releases) == detok.text


def test_smollm2_stop_string_over_multibyte_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer("Done 🎉🎉 then more", add_special_tokens=False)["input_ids"]
    detok, releases = run(smollm2_tokenizer, ids, iter(lambda: 1, 0), stop=("🎉🎉",))
    assert detok.stop_hit and detok.text == "Done "
    assert "".join(releases) == "Done "


# --- cost per token ---------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 8])
def test_work_per_token_does_not_grow_with_output_length(smollm2_tokenizer, monkeypatch, chunk):
    """2,000 tokens, with a stop string that never appears: each add decodes only
    the previous chunk, pending tokens and the new ones, and the stop search looks
    only at the new tail; neither grows with the text."""
    counting = CountingTokenizer(smollm2_tokenizer)
    ids = smollm2_tokenizer(SAMPLE * 30, add_special_tokens=False)["input_ids"][:2000]
    assert len(ids) == 2000
    searched: list[int] = []
    real_find_stop = detokenize.find_stop
    monkeypatch.setattr(
        detokenize, "find_stop", lambda text, stop: searched.append(len(text)) or real_find_stop(text, stop)
    )

    detok = IncrementalDetokenizer(counting, stop=("<never>",))
    per_add = []
    for piece in chunked(ids, iter(lambda: chunk, 0)):
        before = sum(counting.decoded)
        assert not detok.add(piece)
        detok.release(final=False)
        per_add.append(sum(counting.decoded) - before)

    assert detok.text == smollm2_tokenizer.decode(ids)
    # The text repeats, so the second half costs what the first did if nothing grows.
    half = len(per_add) // 2
    assert max(per_add[half:]) <= max(per_add[:half])
    assert sum(per_add[half:]) <= 1.1 * sum(per_add[:half])
    assert sum(per_add) / len(ids) <= 6  # ids decoded per token: previous chunk, pending, new, twice
    assert max(per_add) <= 10 * (chunk + 3)
    longest_token = max(len(smollm2_tokenizer.decode([t])) for t in set(ids))
    assert max(searched) <= len("<never>") - 1 + chunk * longest_token + 3


def test_invalid_utf8_run_does_not_grow_window(smollm2_tokenizer):
    """A text that keeps ending in U+FFFD (a model emitting lone lead bytes) would
    keep every token pending; splitting bounds the work per token anyway."""
    counting = CountingTokenizer(smollm2_tokenizer)
    lead_bytes = smollm2_tokenizer.convert_tokens_to_ids(["Ã", "Ä", "ð"])  # bytes 0xC3, 0xC4, 0xF0
    assert all(smollm2_tokenizer.decode([t]) == "\ufffd" for t in lead_bytes)
    ids = [lead_bytes[i % 3] for i in range(2000)]
    detok = IncrementalDetokenizer(counting)
    per_add = []
    for t in ids:
        before = sum(counting.decoded)
        detok.add([t])
        per_add.append(sum(counting.decoded) - before)
    assert detok.text == smollm2_tokenizer.decode(ids) == "\ufffd" * 2000
    assert sum(per_add) / len(ids) <= 4 * MAX_PENDING_TOKENS
    assert max(per_add[-200:]) <= max(per_add[:200])
