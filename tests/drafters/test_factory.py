"""Drafters built from the command line's flat options through the builder registry."""

import pytest

from fastdecode.drafters import available_drafters
from fastdecode.drafters.base import BUILDERS, readers
from fastdecode.drafters.factory import DrafterOptions
from fastdecode.errors import ConfigError


def test_every_registered_drafter_declares_its_builder():
    assert BUILDERS.names() == available_drafters()


@pytest.mark.parametrize("name", ["ngram", "prompt-lookup", "suffix", "recycling"])
def test_a_settings_only_drafter_is_built_with_k(name):
    options = DrafterOptions(name=name, k=3)
    assert not options.needs_target
    drafter = options.build()
    assert drafter.name == name and drafter.k == 3


def test_ngram_settings_reach_the_drafters_that_read_them():
    ngram = DrafterOptions(name="ngram", ngram_n=3, ngram_min_count=2, ngram_min_prob=0.25).build()
    assert (ngram.n, ngram.min_count, ngram.min_prob) == (3, 2, 0.25)
    assert DrafterOptions(name="recycling", ngram_n=4).build().n == 4
    assert readers("ngram_n") == ["ngram", "recycling", "hybrid"]
    assert readers("draft_model") == ["draft-model", "hybrid"]


@pytest.mark.parametrize("name", ["draft-model", "layer-skip", "hybrid"])
def test_a_model_drafter_needs_the_target(name):
    options = DrafterOptions(name=name)
    assert options.needs_target
    with pytest.raises(ConfigError, match=f"the {name} drafter needs the target model"):
        options.build()


def test_none_is_plain_decoding():
    assert DrafterOptions().build() is None
