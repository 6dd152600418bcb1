"""The shipped texts: the WikiText-2 raw test split as the papers join it, and a calibration
text kept apart from it."""

import hashlib

from fastdecode.data import corpora


def test_evaluation_text_is_the_wikitext2_raw_test_split_joined_with_blank_lines():
    text = corpora.evaluation_text()
    assert len(text) == 1_294_336
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == (
        "696cca6b65a171b0a358a4be6732cdfdf2dd6164a32e20fd70e3c13fc4dfae83"
    )
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English film")
    assert "<unk>" not in text  # the raw split, not the tokenized one
    assert text.endswith("Eddie Pelkey . \n\n\n")


def test_join_rows_turns_blank_lines_into_empty_rows():
    assert corpora.join_rows(" \n = A = \n \n B \n") == "\n\n = A = \n\n\n\n\n B \n"


def test_calibration_text_is_apart_from_the_evaluation_text():
    calibration, evaluation = corpora.calibration_text(), corpora.evaluation_text()
    assert 100_000 <= len(calibration.encode("utf-8")) <= 200_000
    lines = [line for line in calibration.splitlines() if len(line) > 40]
    assert lines and not any(line in evaluation for line in lines[:200])


def test_the_texts_ship_with_their_licence_and_source():
    from importlib import resources

    data = resources.files("fastdecode").joinpath("data")
    wikitext = data.joinpath("wikitext-2-raw")
    assert "CC BY-SA 3.0" in wikitext.joinpath("LICENSE").read_text(encoding="utf-8")
    readme = wikitext.joinpath("README.md").read_text(encoding="utf-8")
    assert "Merity" in readme and "github.com" in readme
    assert "public domain" in data.joinpath("tinyshakespeare/README.md").read_text(encoding="utf-8")
