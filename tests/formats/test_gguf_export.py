"""A transformers model written as llama.cpp's converter writes it (fastdecode.formats.gguf_export)."""

import numpy as np
import pytest
import torch
from tiny_models import tiny_gemma3, tiny_llama

from fastdecode.errors import ConfigError
from fastdecode.formats.gguf_export import export_gguf, llama_permute
from fastdecode.loading import BUILTIN_MODELS

VOCAB = 49152  # the embedded model's tokenizer is copied into the file
TOKENIZER = BUILTIN_MODELS["smollm2-135m"].locate()
SMALL_VOCAB = 128
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def _tensors(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return reader, {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A GGUF of SMALL_VOCAB tokenizer keys alone: what a test of names, metadata and blocks
    copies (reading back the embedded model's 49,152 tokens takes gguf-py's reader seconds; the
    integration tests export with that vocabulary and load the file in transformers)."""
    from gguf_files import write_tokenizer_gguf

    return write_tokenizer_gguf(tmp_path_factory.mktemp("tokenizer") / "tokenizer.gguf", SMALL_VOCAB)


def test_a_llama_is_written_with_gguf_names_permuted_q_and_k_and_gguf_py_blocks(tmp_path, small_tokenizer):
    from gguf import GGMLQuantizationType, quants

    model = tiny_llama(0, **dict(SMALL, vocab_size=SMALL_VOCAB), tie_word_embeddings=False)
    path = export_gguf(model, tmp_path / "m.gguf", small_tokenizer, "q8_0")
    reader, tensors = _tensors(path)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    assert reader.fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    layer = model.model.layers[1].self_attn
    for name, weight, heads in (("attn_q", layer.q_proj.weight, 4), ("attn_k", layer.k_proj.weight, 2)):
        expected = quants.quantize(llama_permute(weight.detach().numpy(), heads), GGMLQuantizationType.Q8_0)
        assert np.array_equal(np.asarray(tensors[f"blk.1.{name}.weight"].data), expected)
    assert tensors["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert tensors["output.weight"].tensor_type == GGMLQuantizationType.Q8_0
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == SMALL_VOCAB
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:4] == ["<unk>", "<s>", "</s>", "!"]
    assert reader.fields["tokenizer.ggml.merges"].contents() == ["t 1", "t 2"]


def test_tensor_types_give_some_kinds_another_type(tmp_path, small_tokenizer):
    """llama-quantize's --tensor-type: the FFN in MXFP4 (gguf-py's quantizer), the rest in the file's type."""
    from gguf import GGMLQuantizationType, quants

    model = tiny_llama(0, **dict(SMALL, vocab_size=SMALL_VOCAB))
    ffn = {"ffn_gate": "mxfp4", "ffn_up": "mxfp4", "ffn_down": "mxfp4"}
    _, tensors = _tensors(export_gguf(model, tmp_path / "m.gguf", small_tokenizer, "q8_0", tensor_types=ffn))
    for i in range(2):
        for kind in ffn:
            assert tensors[f"blk.{i}.{kind}.weight"].tensor_type == GGMLQuantizationType.MXFP4
        assert tensors[f"blk.{i}.attn_v.weight"].tensor_type == GGMLQuantizationType.Q8_0
    down = model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    expected = quants.quantize(down, GGMLQuantizationType.MXFP4)
    assert np.array_equal(np.asarray(tensors["blk.1.ffn_down.weight"].data), expected)
    with pytest.raises(ConfigError, match="no tensor of kind ffn_upp"):
        export_gguf(model, tmp_path / "x.gguf", small_tokenizer, "q8_0", tensor_types={"ffn_upp": "mxfp4"})
    with pytest.raises(ConfigError, match="cannot quantize to Q4_K"):
        export_gguf(model, tmp_path / "x.gguf", small_tokenizer, "q8_0", tensor_types={"ffn_up": "q4_k"})


def test_llama_permute_interleaves_each_heads_rotary_halves():
    w = np.arange(8)[:, None] * np.ones((1, 3))  # one head of dim 8, rows 0..7
    assert llama_permute(w, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_what_cannot_be_written_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="vocabulary has 49152 tokens, the model 96"):
        export_gguf(tiny_llama(0), tmp_path / "m.gguf", TOKENIZER)
    with pytest.raises(ConfigError, match="cannot quantize to Q4_K"):
        export_gguf(tiny_llama(0, **SMALL), tmp_path / "m.gguf", TOKENIZER, "q4_k")


def _logits_after_gguf(model, path, ids):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits, loaded.eval()(ids).logits


@pytest.mark.integration
@pytest.mark.parametrize(
    "build",
    [
        lambda: tiny_llama(1, **SMALL),
        lambda: _tiny_qwen3(),
        # Gemma 3 as llama.cpp knows it: every sixth layer global, query scale 1/sqrt(head_dim).
        lambda: tiny_gemma3(2, **SMALL, head_dim=256, query_pre_attn_scalar=256, layer_types=None, num_hidden_layers=6),
    ],
    ids=["llama", "qwen3", "gemma3"],
)
def test_transformers_reads_back_the_same_model(tmp_path, build):
    model = build()
    path = export_gguf(model, tmp_path / "m.gguf", TOKENIZER, "f32")
    ids = torch.tensor([[1, 50, 700, 9000, 33, 48000, 5]])
    original, loaded = _logits_after_gguf(model, path, ids)
    torch.testing.assert_close(loaded, original, rtol=1e-4, atol=1e-4)


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    config = Qwen3Config(**SMALL, head_dim=128, num_hidden_layers=2, max_position_embeddings=128)
    return Qwen3ForCausalLM(config).eval()
