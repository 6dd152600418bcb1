"""The native decoder's layers read the weight-format registry: a format registered in
``fastdecode.formats`` runs on the native target with no change to the backend."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_llama

from fastdecode.backends import PagedSequence, make_target
from fastdecode.backends.native_weights import NativeLinears
from fastdecode.errors import ConfigError
from fastdecode.formats import WEIGHT_FORMATS, WeightFormat, register_format
from fastdecode.formats.float import make_float_linear
from fastdecode.quant import GGUFBlockConfig, quantize_

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


def halved(weight, bias, float_kernel):
    return make_float_linear(weight / 2, bias, float_kernel)


class CountingLayers:
    """A per-model builder (``NativeLayers``) that runs each module's own weight doubled."""

    def __init__(self, model, float_kernel: str) -> None:
        self.float_kernel = float_kernel
        self.counts: dict[str, int] = {}

    def __call__(self, modules, bias):
        self.counts["doubled"] = self.counts.get("doubled", 0) + len(modules)
        return make_float_linear(torch.cat([m.weight.detach() * 2 for m in modules]), bias, self.float_kernel)

    @property
    def weights(self) -> str:
        return "doubled-test"

    def weights_with(self, saved: Counter) -> str:
        return "doubled-test:" + "+".join(saved + Counter(self.counts))

    @property
    def note(self) -> str | None:
        return "every layer doubled"


@pytest.fixture
def registered():
    """Registers the test formats for one test, then removes them."""
    formats = [
        WeightFormat("half-test", "the weights halved", native_linear=halved),
        WeightFormat("blocky-test", "halved, native only", native_linear=halved, native_only=True),
        WeightFormat("doubled-test", "each module doubled", native_layers=CountingLayers),
    ]
    for fmt in formats:
        register_format(fmt)
    yield
    for fmt in formats:
        WEIGHT_FORMATS.unregister(fmt.name)


def test_a_registered_format_runs_natively_through_its_native_linear(model, registered):
    attn = model.model.layers[0].self_attn
    linears = NativeLinears(model, "half-test", "torch")
    qkv = linears([attn.q_proj, attn.k_proj, attn.v_proj])
    x = torch.randn(3, attn.q_proj.in_features)
    w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    assert torch.equal(qkv(x), F.linear(x, w / 2))
    assert linears.weights == "half-test" and linears.note is None
    assert make_target(model, "native", "half-test", "torch").weights == "half-test"


def test_a_format_with_native_layers_builds_every_plain_module_with_them(model, registered):
    target = make_target(model, "native", "doubled-test", "torch")
    assert target.weights == "doubled-test" and target.kernel_note == "every layer doubled"
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, attn.o_proj.in_features)
    assert torch.equal(target.layers[0].o(x), F.linear(x, attn.o_proj.weight.detach() * 2))


def test_saved_layers_are_named_beside_what_the_format_built(model, registered):
    saved = copy.deepcopy(model)
    quantize_(saved, GGUFBlockConfig("q4_0"))  # the LM head stays float
    assert make_target(saved, "native", "doubled-test", "torch").weights == "doubled-test:q4_0+doubled"
    assert make_target(saved, "native", "gguf").weights == "gguf:q4_0+q8_0"  # no GGUF file: the head is q8_0
    assert make_target(saved, "native", "q4_1").weights == "q4_0+q4_1"
    assert make_target(saved, "native", "half-test", "torch").weights == "q4_0+half-test"


def test_a_native_only_format_is_refused_on_transformers(model, registered):
    with pytest.raises(
        ConfigError,
        match=r"^--weights blocky-test \(GGUF block formats\) runs on the native backend only: "
        r"use --backend native or auto$",
    ):
        make_target(model, "hf", "blocky-test")
    assert PagedSequence(make_target(model, "native", "blocky-test")).forward(PROMPT, 1).shape[-1] == 96


@pytest.mark.parametrize("name", ["int3", "int4-gptq"])
def test_a_name_no_target_runs_is_refused_with_the_weights_choices(model, name):
    message = (
        f"^unknown weight precision '{name}'; choose one of float, bf16, int8, int4, q8_0, q4_0, q4_1, gguf, sparse24, "
        "sparse24-f32, w8a8$"
    )
    with pytest.raises(ConfigError, match=message):
        make_target(model, "native", name)
    with pytest.raises(ConfigError, match=message):
        NativeLinears(model, name)
