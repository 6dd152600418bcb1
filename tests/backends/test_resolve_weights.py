"""``weights="auto"`` (``fastdecode.backends.resolve_weights``): a model runs the way it is held - a GGUF
file still in its file on its own blocks on the native decoder, anything else as float."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastdecode.backends import make_target, resolve_weights
from fastdecode.errors import ConfigError


def _model(lazy: bool, gguf_file: str | None):
    return SimpleNamespace(
        fastdecode_lazy=object() if lazy else None, config=SimpleNamespace(fastdecode_gguf_file=gguf_file)
    )


@pytest.mark.parametrize(
    "lazy, gguf_file, backend, weights",
    [
        (True, "m.gguf", "native", "gguf"),  # the file's own blocks, at the size of the file
        (True, "m.gguf", "hf", "float"),  # transformers runs the float model
        (False, "m.gguf", "native", "float"),  # already dequantized (load_model(..., lazy=False)): as it is held
        (True, None, "native", "float"),  # a safetensors directory's skeleton
        (False, None, "native", "float"),
    ],
)
def test_auto_is_the_files_blocks_only_for_a_gguf_skeleton_on_the_native_decoder(lazy, gguf_file, backend, weights):
    assert resolve_weights(_model(lazy, gguf_file), backend) == weights


def test_an_explicit_weights_always_wins():
    for weights in ("float", "q8_0", "gguf", "int8"):
        assert resolve_weights(_model(True, "m.gguf"), "hf", weights) == weights
        assert resolve_weights(_model(False, None), "native", weights) == weights


def test_make_target_defaults_to_auto(tiny_model):
    assert make_target(tiny_model).weights == "float"  # a float model
    assert make_target(tiny_model, "native", "auto").weights == "float"
    with pytest.raises(ConfigError, match=r"unknown weight precision 'bogus'"):
        make_target(tiny_model, "native", "bogus")
