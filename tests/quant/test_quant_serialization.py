import json

import pytest
import torch

from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.quant import (
    GGUFBlockConfig,
    GGUFBlockLinear,
    GPTQConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    is_quantized_dir,
    load_quantized,
    quantize_,
    quantized_layers,
    save_quantized,
)
from fastdecode.quant.serialization import QUANT_JSON, WEIGHTS_FILE


@pytest.fixture(scope="module")
def saved_int4(tmp_path_factory, build_llama):
    """(directory, quantized model) for an int4 model with tied embeddings and a quantized head."""
    model = build_llama(tie_word_embeddings=True)
    config = Int4WeightOnlyConfig(group_size=64)
    quantize_(model, config, skip=())
    out = tmp_path_factory.mktemp("int4")
    save_quantized(model, None, out, config)
    return out, model


@pytest.mark.parametrize(
    "config, skip",
    [
        (Int8WeightOnlyConfig(), ("lm_head",)),
        (Int4WeightOnlyConfig(group_size=32), ()),
        (GPTQConfig(bits=4, group_size=64, calibration_token_ids=[list(range(3, 67))]), ("lm_head",)),
    ],
    ids=["int8", "int4", "int4-gptq"],
)
def test_round_trip_gives_bit_identical_logits(config, skip, quant_llama, probe_ids, run_logits, tmp_path):
    quantize_(quant_llama, config, skip=skip)
    save_quantized(quant_llama, None, tmp_path, config)
    assert is_quantized_dir(tmp_path)
    loaded, tokenizer = load_quantized(tmp_path)
    assert tokenizer is None
    assert quantized_layers(loaded) == quantized_layers(quant_llama)
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(quant_llama, probe_ids))


def test_round_trip_with_tied_embeddings_and_a_quantized_head(saved_int4, probe_ids, run_logits):
    directory, model = saved_int4
    loaded, _ = load_quantized(directory)
    assert "lm_head" in quantized_layers(loaded)
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(model, probe_ids))


def test_round_trip_with_tied_embeddings_and_a_float_head(build_llama, probe_ids, run_logits, tmp_path):
    model = build_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    config = Int8WeightOnlyConfig()
    quantize_(model, config)
    save_quantized(model, None, tmp_path, config)
    loaded, _ = load_quantized(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(model, probe_ids))


def test_record_names_the_method_and_layout(saved_int4):
    directory, _ = saved_int4
    record = json.loads((directory / QUANT_JSON).read_text())
    assert record["quantization"] == {"method": "int4", "group_size": 64}
    assert record["dtype"] == "float32"
    assert record["layers"]["lm_head"] == {"kind": "int4", "group_size": 64}


def test_tokenizer_round_trips(quant_llama, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    config = Int8WeightOnlyConfig()
    quantize_(quant_llama, config)
    save_quantized(quant_llama, tokenizer, tmp_path, config)
    _, loaded = load_quantized(tmp_path)
    assert loaded("hello world")["input_ids"] == [1, 2]


def test_saving_an_unquantized_model_is_refused(quant_llama, tmp_path):
    with pytest.raises(ConfigError, match="quantize_"):
        save_quantized(quant_llama, None, tmp_path, Int8WeightOnlyConfig())


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_not_a_quantized_dir(tmp_path):
    assert not is_quantized_dir(tmp_path)
    with pytest.raises(ModelLoadError, match=QUANT_JSON):
        load_quantized(tmp_path)
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_quantized(tmp_path / "missing")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / QUANT_JSON).write_text("{not json"), "corrupt"),
        (lambda d: (d / QUANT_JSON).write_text('{"format_version": 99}'), "format_version"),
        (lambda d: (d / WEIGHTS_FILE).unlink(), "missing"),
        (lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:1000]), "corrupt"),
        (lambda d: (d / WEIGHTS_FILE).write_bytes(b"\x00" * 64), "corrupt"),
        (lambda d: (d / "config.json").write_text("[]"), "config"),
        (
            lambda d: (d / QUANT_JSON).write_text(
                json.dumps({**json.loads((d / QUANT_JSON).read_text()), "layers": {"model.nope": {"kind": "int8"}}})
            ),
            "no layer",
        ),
        (
            lambda d: (d / QUANT_JSON).write_text(
                json.dumps({**json.loads((d / QUANT_JSON).read_text()), "layers": {}})
            ),
            "mismatched",
        ),
    ],
    ids=["bad-json", "version", "no-weights", "truncated", "garbage", "bad-config", "unknown-layer", "layout-mismatch"],
)
def test_damaged_directories_raise_model_load_error(saved_int4, tmp_path, damage, match):
    directory = _copy(saved_int4[0], tmp_path / "copy")
    damage(directory)
    with pytest.raises(ModelLoadError, match=match):
        load_quantized(directory)


def test_only_cpu_is_supported(saved_int4):
    with pytest.raises(ConfigError, match="CPU"):
        load_quantized(saved_int4[0], device="cuda")


# -- GGUF block formats ------------------------------------------------------


@pytest.fixture(scope="module")
def saved_q4_1(tmp_path_factory, build_llama):
    """(directory, quantized model) for a q4_1 model with tied embeddings and a block head."""
    model = build_llama(tie_word_embeddings=True)
    config = GGUFBlockConfig("q4_1")
    quantize_(model, config, skip=())
    out = tmp_path_factory.mktemp("q4_1")
    save_quantized(model, None, out, config)
    return out, model


def _blocks(model):
    return {name: m.blocks for name, m in model.named_modules() if isinstance(m, GGUFBlockLinear)}


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_block_round_trip_keeps_every_byte(fmt, quant_llama, probe_ids, run_logits, tmp_path):
    config = GGUFBlockConfig(fmt)
    quantize_(quant_llama, config)
    save_quantized(quant_llama, None, tmp_path, config)
    loaded, _ = load_quantized(tmp_path)
    saved, back = _blocks(quant_llama), _blocks(loaded)
    assert len(saved) == 14 and saved.keys() == back.keys()
    assert all(back[name].dtype == torch.uint8 and torch.equal(back[name], saved[name]) for name in saved)
    assert quantized_layers(loaded) == quantized_layers(quant_llama)
    assert type(loaded.lm_head) is torch.nn.Linear
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(quant_llama, probe_ids))


def test_block_round_trip_with_tied_embeddings_and_a_block_head(saved_q4_1, probe_ids, run_logits):
    directory, model = saved_q4_1
    loaded, _ = load_quantized(directory)
    assert isinstance(loaded.lm_head, GGUFBlockLinear)
    assert torch.equal(loaded.lm_head.blocks, model.lm_head.blocks)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(run_logits(loaded, probe_ids), run_logits(model, probe_ids))
    record = json.loads((directory / QUANT_JSON).read_text())
    assert record["quantization"] == {"method": "q4_1"}
    assert record["layers"]["lm_head"] == {"kind": "gguf_block", "format": "q4_1", "shape": [128, 64]}


def _edit_layer(directory, name, **changes):
    record = json.loads((directory / QUANT_JSON).read_text())
    record["layers"][name].update(changes)
    (directory / QUANT_JSON).write_text(json.dumps(record))


def _swap_tensor(directory, name, make):
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / WEIGHTS_FILE)
    tensors[name] = make(tensors[name])
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: _edit_layer(d, "lm_head", format="q5_k"), "unknown block format 'q5_k'"),
        (lambda d: _edit_layer(d, "lm_head", shape=[64, 128]), r"recorded as \[64, 128\]"),
        (lambda d: _edit_layer(d, "model.layers.0.mlp.up_proj", format="q8_0"), "corrupt or mismatched"),
        (lambda d: _swap_tensor(d, "lm_head.blocks", lambda t: t[:, :-1].contiguous()), "corrupt or mismatched"),
        (lambda d: _swap_tensor(d, "lm_head.blocks", lambda t: t.to(torch.int16)), "expected uint8"),
        (lambda d: (d / WEIGHTS_FILE).write_bytes((d / WEIGHTS_FILE).read_bytes()[:-100]), "corrupt"),
    ],
    ids=["unknown-format", "shape", "format-mismatch", "short-rows", "dtype", "truncated"],
)
def test_damaged_block_directories_raise_model_load_error(saved_q4_1, tmp_path, damage, match):
    directory = _copy(saved_q4_1[0], tmp_path / "copy")
    damage(directory)
    with pytest.raises(ModelLoadError, match=match):
        load_quantized(directory)
