"""--weights gguf on a model whose GGUF file holds the other block types (Q5_0, Q5_1, Q5_K, Q3_K,
Q2_K, IQ4_NL, IQ4_XS, MXFP4): each tensor runs from the file's own blocks, a fused projection by parts,
and speculation stays lossless."""

import numpy as np
import pytest
import torch
from gguf_files import finish_gguf, random_raw
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.backends import PagedSequence, make_target
from fastdecode.kernels.gguf_blocks import file_blocks, gguf_tensor_names, llama_unpermute
from fastdecode.kernels.gguf_types import BLOCK_FORMATS
from fastdecode.kernels.quant import kernel_unavailable

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]
KERNELS = ["auto", "torch"] if kernel_unavailable() is None else ["torch"]
HEADS, KV_HEADS = 4, 2
# module -> type in the file, per layer; the lm_head is not in the file (q8_0 from its float weight)
LAYOUT = [
    {
        "self_attn.q_proj": "q5_k",
        "self_attn.k_proj": "q3_k",
        "self_attn.v_proj": "iq4_nl",
        "self_attn.o_proj": "q5_0",
        "mlp.gate_proj": "q2_k",
        "mlp.up_proj": "iq4_xs",
        "mlp.down_proj": "q5_1",
    },
    {
        "self_attn.q_proj": "q3_k",
        "self_attn.k_proj": "q3_k",
        "self_attn.v_proj": "q3_k",
        "self_attn.o_proj": "q5_k",
        "mlp.gate_proj": "q5_k",
        "mlp.up_proj": "q5_k",
        "mlp.down_proj": "q6_k",
    },
    {  # gpt-oss's expert weights' type in the FFN
        "self_attn.q_proj": "q5_0",
        "self_attn.k_proj": "q5_0",
        "self_attn.v_proj": "iq4_nl",
        "self_attn.o_proj": "q3_k",
        "mlp.gate_proj": "mxfp4",
        "mlp.up_proj": "mxfp4",
        "mlp.down_proj": "mxfp4",
    },
]
# fp16 scales that make weights of about Llama's init size (~0.02) from each type's integers
SCALE = {"q5_0": 1e-3, "q5_1": 1e-3, "q5_k": 1e-5, "q3_k": 1.5e-4, "q2_k": 5e-4, "iq4_nl": 1.5e-4, "iq4_xs": 5e-6}
SCALE["q6_k"] = SCALE["iq4_xs"]
SCALE["mxfp4"] = 4e-3  # E8M0: 2^(e - 128) near it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama whose weights are a GGUF file's blocks (q and k stored permuted, as
    convert_hf_to_gguf.py stores them), with the file set as transformers' loader sets it."""
    from gguf import GGMLQuantizationType, GGUFWriter

    model = tiny_llama(
        0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(LAYOUT),
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    for i, layout in enumerate(LAYOUT):
        for j, (module_name, name) in enumerate(layout.items()):
            module = model.get_submodule(f"model.layers.{i}.{module_name}")
            rows, cols = module.weight.shape
            f = BLOCK_FORMATS[name]
            bt = file_blocks(f.ggml_type, random_raw(name, rows, cols, seed=10 * i + j, scale=SCALE[name]), cols)
            with torch.no_grad():
                module.weight.copy_(bt.dequantize())
            heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}.get(module_name)
            stored = bt if heads is None else bt.take_rows(np.argsort(llama_unpermute(rows, heads)))
            (tensor,) = gguf_tensor_names(f"model.layers.{i}.{module_name}")
            writer.add_tensor(tensor, stored.blocks, raw_dtype=GGMLQuantizationType(f.ggml_type))
    finish_gguf(writer)
    model.config.fastdecode_gguf_file = str(path)
    return model


def test_every_tensor_runs_as_stored(model):
    target = make_target(model, "native", "gguf")
    kinds = set(target.weights.removeprefix("gguf:").split("+"))
    assert kinds == {t for layout in LAYOUT for t in layout.values()} | {"q8_0"}  # q8_0: the lm_head's fallback
    assert "1 linear layers quantized to q8_0" in target.kernel_note
    first = target.layers[0]
    assert first.qkv.formats == ["q5_k", "q3_k", "iq4_nl"] and first.gate_up.formats == ["q2_k", "iq4_xs"]
    assert target.layers[1].qkv.formats == ["q3_k"]  # neighbours in one type share a part
    assert target.layers[2].gate_up.formats == ["mxfp4"] and target.layers[2].qkv.formats == ["q5_0", "iq4_nl"]


@pytest.mark.parametrize("float_kernel", KERNELS)
def test_a_pass_gives_each_row_a_decode_steps_bits(model, float_kernel):
    target = PagedSequence(make_target(model, "native", "gguf", float_kernel))
    together = target.forward(PROMPT, len(PROMPT))
    target.reset()
    one_by_one = torch.cat([target.forward([t], 1) for t in PROMPT])
    assert torch.equal(together, one_by_one)
    ref = PagedSequence(make_target(model, "native", "float")).forward(PROMPT, len(PROMPT))  # the same weights
    assert (together - ref).abs().max() < 0.05 * ref.abs().max()


def test_ngram_drafting_is_token_identical_to_plain(model, tokenizer):
    plain = Engine(model, tokenizer, target=make_target(model, "native", "gguf")).generate(PROMPT, max_new_tokens=32)
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram", n=3), target=make_target(model, "native", "gguf"))
    result = engine.generate(PROMPT, max_new_tokens=32, draft_k=4)
    assert result.token_ids == plain.token_ids
    assert result.acceptance.drafted_tokens > 0
