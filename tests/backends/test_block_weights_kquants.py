"""--weights gguf on a model whose GGUF file holds K-quants: each Q4_K / Q6_K tensor runs
from the file's own super-blocks, a fused projection by parts, and speculation stays lossless."""

import numpy as np
import pytest
import torch
from gguf_files import finish_gguf
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.backends import PagedSequence, make_target
from fastdecode.kernels.gguf_blocks import K_FORMATS, QK_K, BlockTensor, gguf_tensor_names, llama_unpermute
from fastdecode.kernels.quant import kernel_unavailable

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]
KERNELS = ["auto", "torch"] if kernel_unavailable() is None else ["torch"]
HEADS, KV_HEADS = 4, 2
# module -> format in the file, per layer; the lm_head is not in the file (q8_0 from its float weight)
LAYOUT = [
    {
        "self_attn.q_proj": "q4_k",
        "self_attn.k_proj": "q6_k",
        "self_attn.v_proj": "q8_0",
        "self_attn.o_proj": "q4_k",
        "mlp.gate_proj": "q6_k",
        "mlp.up_proj": "q4_k",
        "mlp.down_proj": "q6_k",
    },
    {
        "self_attn.q_proj": "q4_k",
        "self_attn.k_proj": "q4_k",
        "self_attn.v_proj": "q4_k",
        "self_attn.o_proj": "q6_k",
        "mlp.gate_proj": "q4_k",
        "mlp.up_proj": "q4_k",
        "mlp.down_proj": "q4_k",
    },
]


def random_k_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> BlockTensor:
    """Random super-blocks with weights of Llama's init size (~0.02)."""
    f = K_FORMATS[fmt]
    b = rng.integers(0, 256, (rows, cols // QK_K, f.block_bytes), dtype=np.uint8)
    for at in (0, 2) if fmt == "q4_k" else (208,):
        d = rng.uniform(0.5, 1.0, b.shape[:2]) * (2e-5 if fmt == "q4_k" else 5e-6)
        b[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return BlockTensor(f, b.reshape(rows, -1), cols)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama whose weights are a GGUF file's blocks (q and k stored permuted, as
    convert_hf_to_gguf.py stores them), with the file set as transformers' loader sets it."""
    from gguf import GGMLQuantizationType, GGUFWriter

    model = tiny_llama(
        0,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("gguf") / "kquants.gguf"
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i, layout in enumerate(LAYOUT):
        for module_name, fmt in layout.items():
            name = f"model.layers.{i}.{module_name}"
            module = model.get_submodule(name)
            if fmt == "q8_0":
                bt = BlockTensor.quantize(module.weight, fmt)
            else:
                bt = random_k_blocks(fmt, *module.weight.shape, rng)
            with torch.no_grad():
                module.weight.copy_(bt.dequantize())
            heads = {"self_attn.q_proj": HEADS, "self_attn.k_proj": KV_HEADS}.get(module_name)
            stored = bt if heads is None else bt.take_rows(np.argsort(llama_unpermute(bt.rows, heads)))
            (tensor,) = gguf_tensor_names(name)
            writer.add_tensor(tensor, stored.blocks, raw_dtype=GGMLQuantizationType(bt.format.ggml_type))
    finish_gguf(writer)
    model.config.fastdecode_gguf_file = str(path)
    return model


def test_k_quant_tensors_run_as_stored_and_name_the_numeric_model(model):
    target = make_target(model, "native", "gguf")
    assert target.weights == "gguf:q4_k+q6_k+q8_0"  # 9 q4_k, 4 q6_k, 1 q8_0 + the lm_head's fallback
    assert (
        "1 linear layers quantized to q8_0" in target.kernel_note and "lm_head: not in the file" in target.kernel_note
    )
    first = target.layers[0]
    assert first.qkv.formats == ["q4_k", "q6_k", "q8_0"]  # a fused projection by parts
    assert first.gate_up.formats == ["q6_k", "q4_k"] and first.down.formats == ["q6_k"]
    assert target.layers[1].qkv.formats == ["q4_k"]  # neighbours in one format share a part


@pytest.mark.parametrize("float_kernel", KERNELS)
def test_a_pass_gives_each_row_a_decode_steps_bits(model, float_kernel):
    executor = make_target(model, "native", "gguf", float_kernel)
    assert (executor._layer_calls is not None) == (float_kernel == "auto")
    target = PagedSequence(executor)
    together = target.forward(PROMPT, len(PROMPT))
    target.reset()
    one_by_one = torch.cat([target.forward([t], 1) for t in PROMPT])
    assert torch.equal(together, one_by_one)
    float32 = PagedSequence(make_target(model, "native", "float"))  # the same weights in float32
    ref = float32.forward(PROMPT, len(PROMPT))
    assert (together - ref).abs().max() < 0.05 * ref.abs().max()


def test_ngram_drafting_is_token_identical_to_plain(model, tokenizer):
    plain = Engine(model, tokenizer, target=make_target(model, "native", "gguf")).generate(PROMPT, max_new_tokens=32)
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram", n=3), target=make_target(model, "native", "gguf"))
    result = engine.generate(PROMPT, max_new_tokens=32, draft_k=4)
    assert result.token_ids == plain.token_ids
    assert result.acceptance.drafted_tokens > 0
