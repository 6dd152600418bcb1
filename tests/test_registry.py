"""The one Registry class, and every registry in the package built on it."""

import pytest

from fastdecode.bench.datasets import DATASETS, DatasetOptions, load_samples, register_dataset
from fastdecode.bench.peers import PEERS
from fastdecode.bench.sweeps import SWEEPS, register_sweep
from fastdecode.drafters import base as drafters_base
from fastdecode.drafters import build_drafter, register_drafter
from fastdecode.errors import ConfigError
from fastdecode.quant.api import QUANT_HANDLERS, Int8WeightOnlyConfig, quantize_, register_quant_method
from fastdecode.registry import Registry


def test_register_get_names_contains():
    colors = Registry("color")

    @colors.register("red")
    def red():
        return "#f00"

    colors.register("blue")(lambda: "#00f")
    assert colors.get("red") is red and colors.get("red")() == "#f00"
    assert colors.names() == ["blue", "red"]
    assert "red" in colors and "green" not in colors and len(colors) == 2
    colors.unregister("red")
    assert colors.names() == ["blue"]


def test_a_duplicate_name_is_refused_and_the_first_entry_kept():
    colors = Registry("color")
    first = colors.register("red")(object())
    with pytest.raises(ValueError, match="color 'red' is already registered"):
        colors.register("red")(object())
    assert colors.get("red") is first


def test_an_unknown_name_is_a_config_error_listing_the_choices():
    colors = Registry("color")
    colors.register("red")(1)
    colors.register("blue")(2)
    with pytest.raises(ConfigError, match=r"^unknown color 'green'; choose from: blue, red$"):
        colors.get("green")


def test_type_keys_are_listed_by_class_name():
    handlers = Registry("config")
    handlers.register(int)("int handler")
    with pytest.raises(ConfigError, match="unknown config 'str'; choose from: int$"):
        handlers.get(str)


@pytest.mark.parametrize(
    "register, name",
    [
        (register_drafter, "ngram"),
        (register_quant_method, Int8WeightOnlyConfig),
        (register_dataset, "suite"),
        (register_sweep, "ngram-nk"),
        (PEERS.register, "hf"),
    ],
    ids=["drafter", "quant", "dataset", "sweep", "peer"],
)
def test_every_registry_refuses_a_duplicate(register, name):
    with pytest.raises(ValueError, match="already registered|registered twice"):
        register(name)(lambda *a, **k: None)


@pytest.mark.parametrize("registry", [QUANT_HANDLERS, DATASETS, SWEEPS, PEERS], ids=lambda r: r.kind)
def test_the_package_registries_are_registries(registry):
    assert isinstance(registry, Registry) and len(registry) > 0


@pytest.mark.skipif(not hasattr(drafters_base, "DRAFTERS"), reason="drafters/base.py not yet on Registry")
def test_the_drafter_registry_is_a_registry():
    assert isinstance(drafters_base.DRAFTERS, Registry)
    assert {"ngram", "prompt-lookup"} <= set(drafters_base.DRAFTERS.names())


@pytest.mark.parametrize(
    "lookup, message",
    [
        (lambda: build_drafter("magic"), "unknown drafter 'magic'; choose .*ngram, prompt-lookup"),
        (
            lambda: quantize_(None, object()),
            "unknown quantization config 'object'; choose from: AWQConfig, GGUFBlockConfig, "
            "GPTQConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig",
        ),
        (
            lambda: load_samples(["magic"], DatasetOptions()),
            "unknown dataset 'magic'; choose from: cnn_dailymail, humaneval, prompts, suite, xsum",
        ),
        (lambda: SWEEPS.get("magic"), "unknown sweep 'magic'; choose from: ngram-nk, quantized-drafters"),
        (
            lambda: PEERS.get("magic"),
            "unknown peer 'magic'; choose from: hf, hf-assisted, hf-prompt-lookup, llama-cpp, ",
        ),
    ],
    ids=["drafter", "quant", "dataset", "sweep", "peer"],
)
def test_an_unknown_name_lists_the_choices(lookup, message):
    with pytest.raises(ConfigError, match=message):
        lookup()
