"""Models quantized to GGUF's block formats (``quantize_(model, GGUFBlockConfig(...))``,
``fastdecode quantize --method q8_0|q4_0|q4_1``), saved, loaded back and run: the native
backend must compute exactly what ``--weights q4_0`` computes on the float model."""

import copy
import json

import pytest
import torch
from tiny_models import tiny_llama

from fastdecode import Engine, build_drafter
from fastdecode.backends import PagedSequence, make_target
from fastdecode.backends.linear import BlockLinear
from fastdecode.cli import main
from fastdecode.kernels.quant import kernel_unavailable
from fastdecode.quant import GGUFBlockConfig, load_quantized, quantize_, save_quantized
from fastdecode.quant.serialization import WEIGHTS_FILE

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]
KERNELS = ["auto", "torch"] if kernel_unavailable() is None else ["torch"]


@pytest.fixture(scope="module")
def float_model():
    return tiny_llama(0, num_hidden_layers=3, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def saved_and_loaded(float_model, fmt, directory, skip=()):
    model = copy.deepcopy(float_model)
    config = GGUFBlockConfig(fmt)
    quantize_(model, config, skip=skip)
    save_quantized(model, None, directory, config)
    return load_quantized(directory)[0]


@pytest.fixture(scope="module")
def loaded_q4_0(float_model, tmp_path_factory):
    """q4_0 with the LM head quantized too, as --weights q4_0 quantizes it."""
    return saved_and_loaded(float_model, "q4_0", tmp_path_factory.mktemp("q4_0"))


@pytest.mark.parametrize("float_kernel", KERNELS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_a_loaded_model_computes_what_weights_fmt_computes_on_the_float_model(float_model, fmt, float_kernel, tmp_path):
    loaded = saved_and_loaded(float_model, fmt, tmp_path)
    target = make_target(loaded, "native", "float", float_kernel)
    on_load = make_target(float_model, "native", fmt, float_kernel)
    assert target.weights == fmt == on_load.weights
    assert target.float_kernel == on_load.float_kernel == ("qdot" if float_kernel == "auto" else "torch")
    assert isinstance(target.layers[0].qkv, BlockLinear) and isinstance(target.lm_head, BlockLinear)
    assert target.weight_bytes() == on_load.weight_bytes()
    # On the C kernels each layer is one fused call, as for --weights q4_0.
    assert (target._layer_calls is not None) == (on_load._layer_calls is not None) == (float_kernel == "auto")
    assert torch.equal(
        PagedSequence(target).forward(PROMPT, len(PROMPT)), PagedSequence(on_load).forward(PROMPT, len(PROMPT))
    )


def test_a_float_head_takes_the_weights_asked_for(float_model, tmp_path):
    """The default skips the LM head: saved modules run as they are, and --weights
    quantizes the float ones left (as for saved int8/int4 models); target.weights says what ran."""
    loaded = saved_and_loaded(float_model, "q4_0", tmp_path, skip=("lm_head",))
    on_load = PagedSequence(make_target(float_model, "native", "q4_0")).forward(PROMPT, len(PROMPT))
    same = make_target(loaded, "native", "q4_0")
    assert same.weights == "q4_0"
    assert torch.equal(PagedSequence(same).forward(PROMPT, len(PROMPT)), on_load)
    float_head = make_target(loaded, "native", "float")
    assert float_head.weights == "q4_0+float" and isinstance(float_head.layers[0].down, BlockLinear)
    assert not torch.equal(PagedSequence(float_head).forward(PROMPT, len(PROMPT)), on_load)
    assert make_target(loaded, "native", "int8").weights == "q4_0+int8"


def test_the_transformers_forward_is_close_to_the_native_one(loaded_q4_0):
    native = PagedSequence(make_target(loaded_q4_0, "native")).forward(PROMPT, len(PROMPT))
    with torch.no_grad():
        hf = loaded_q4_0(input_ids=torch.tensor([PROMPT])).logits[0]
    assert (hf - native).abs().max() < 1e-4 * native.abs().max()  # the same block layers; float ops differ


def test_ngram_drafting_on_a_loaded_model_is_token_identical_to_plain(float_model, loaded_q4_0, tokenizer):
    plain = Engine(loaded_q4_0, tokenizer, target=make_target(loaded_q4_0, "native")).generate(
        PROMPT, max_new_tokens=40
    )
    engine = Engine(
        loaded_q4_0, tokenizer, drafter=build_drafter("ngram", n=3), target=make_target(loaded_q4_0, "native")
    )
    spec = engine.generate(PROMPT, max_new_tokens=40, draft_k=4)
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance.drafted_tokens > 0
    on_load = Engine(float_model, tokenizer, target=make_target(float_model, "native", "q4_0"))
    assert on_load.generate(PROMPT, max_new_tokens=40).token_ids == plain.token_ids


# -- the command line ----------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny")
    model = tiny_llama(0, vocab_size=64, hidden_size=64, intermediate_size=128, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(61)]])}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return path


def run(capsys, *args):
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def generate_json(capsys, model, *args):
    prompt = " ".join(f"w{i % 7}" for i in range(30))
    code, out, err = run(
        capsys, "generate", "--model", model, "--prompt", prompt, "--no-chat", "--max-new-tokens", "24", "--json", *args
    )
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def quantized_dir(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "q4_1"
    assert main(["quantize", str(model_dir), "--method", "q4_1", "--out", str(out)]) == 0
    return out


def test_quantize_q4_1_then_generate(capsys, model_dir, quantized_dir, tmp_path):
    code, out, err = run(capsys, "quantize", model_dir, "--method", "q4_1", "--out", tmp_path / "again")
    assert code == 0, err
    assert "(q4_1): weights" in out and "perplexity on the built-in text" in out
    plain = generate_json(capsys, quantized_dir)
    assert plain["weights"] == "q4_1+float" and plain["backend"] == "native"  # the LM head stays float by default
    spec = generate_json(capsys, quantized_dir, "--drafter", "ngram")
    assert spec["token_ids"] == plain["token_ids"]
    # The saved blocks and q4_1 on load give the same tokens, once the float head is q4_1 too.
    on_load = generate_json(capsys, model_dir, "--weights", "q4_1")
    assert generate_json(capsys, quantized_dir, "--weights", "q4_1")["token_ids"] == on_load["token_ids"]


@pytest.mark.parametrize(
    "args, code, pattern",
    [
        (["--method", "q5_0"], 1, "argument --method: invalid choice: 'q5_0'"),  # usage errors exit 1 (issue 42)
        (
            ["--method", "q4_0", "--group-size", "64"],
            1,
            "q4_0 quantizes in fixed blocks of 32 weights and takes no group size",
        ),
    ],
)
def test_bad_quantize_settings(capsys, model_dir, tmp_path, args, code, pattern):
    got, _, err = run(capsys, "quantize", model_dir, *args, "--out", tmp_path / "out")
    assert got == code and pattern in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_corrupt_saved_model_is_one_clear_error(capsys, quantized_dir, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in quantized_dir.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    weights = damaged / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-64])
    code, out, err = run(capsys, "generate", "--model", damaged, "--prompt", "w1 w2")
    assert code == 1 and out == ""
    assert err.startswith("fastdecode: error:") and "corrupt or mismatched" in err
    assert err.count("\n") == 1 and "Traceback" not in err
