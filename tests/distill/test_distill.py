"""distill-drafter on a tiny random-weight Llama with a word-level tokenizer that saves and loads."""

import argparse
import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from fastdecode import Engine, build_drafter, load_model
from fastdecode.backends.base import PagedSequence
from fastdecode.backends.native import NativeTarget
from fastdecode.distill.command import (
    REPORT_FILE,
    DistillSettings,
    add_distill_parser,
    build_shallow_drafter,
    default_layer_indices,
    default_prompts,
    distill_drafter,
    kl_per_token,
    save_drafter,
    target_sequences,
    teacher_top_logprobs,
    train,
    truncated_kl,
)
from fastdecode.errors import ConfigError

VOCAB = 96
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def tiny_target(tie: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config).eval()


def word_tokenizer():
    """Ids 0-3 special, then one id per word "w0".."w91"; a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = (
        "<s>{% for m in messages %} {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} w0{% endif %}"
    )
    return tok


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(1, VOCAB - len(SPECIAL), (n,), generator=g))


TRAIN_PROMPTS = [words(s, 12) for s in range(4)]
HELDOUT_PROMPTS = [words(100 + s, 10) for s in range(2)]
SMALL = dict(steps=4, lr=3e-3, batch_size=2, seq_len=48, new_tokens=16, eval_new_tokens=16, top_k_logprobs=VOCAB)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def distilled(target, tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    settings = DistillSettings(num_layers=2, **SMALL)
    report = distill_drafter(
        target,
        tok,
        out,
        settings,
        progress=False,
        target_spec="tiny",
        train_prompts=TRAIN_PROMPTS,
        heldout_prompts=HELDOUT_PROMPTS,
    )
    return out, report


def test_default_layers_spread_first_and_last():
    assert default_layer_indices(30, 4) == [0, 10, 19, 29]
    assert default_layer_indices(4, 2) == [0, 3]
    assert default_layer_indices(4, 1) == [3]


def test_shallow_drafter_copies_the_chosen_layers(target):
    config_before = target.config.to_dict()
    drafter = build_shallow_drafter(target, layer_indices=[0, 3])
    assert target.config.to_dict() == config_before
    assert target.config.num_hidden_layers == 4 and len(target.model.layers) == 4
    assert drafter.config.num_hidden_layers == 2 and len(drafter.model.layers) == 2
    assert type(drafter) is type(target)
    mine, theirs = drafter.state_dict(), target.state_dict()
    for key, value in mine.items():
        source = key.replace("layers.1.", "layers.3.")
        assert torch.equal(value, theirs[source]), key
    target_ptrs = {p.untyped_storage().data_ptr() for p in target.parameters()}
    assert not target_ptrs & {p.untyped_storage().data_ptr() for p in drafter.parameters()}
    with torch.no_grad():
        drafter.model.layers[0].mlp.down_proj.weight.add_(1.0)
    assert not torch.equal(drafter.model.layers[0].mlp.down_proj.weight, target.model.layers[0].mlp.down_proj.weight)


def test_untrained_drafter_computes_the_targets_layer_subset(target):
    """The drafter is exactly the target run through only those layers (layer skipping)."""
    ids = [1, 40, 71, 9, 55, 23, 88, 14]
    drafter = build_shallow_drafter(target, layer_indices=[0, 2])
    with torch.no_grad():
        mine = drafter(input_ids=torch.tensor([ids])).logits[0]
    skipped = PagedSequence(NativeTarget(copy.deepcopy(target), layers=[0, 2]))  # one sequence on the executor
    torch.testing.assert_close(mine, skipped.forward(ids, len(ids)), rtol=1e-4, atol=1e-5)


def test_tied_embeddings_stay_tied():
    target = tiny_target(tie=True)
    drafter = build_shallow_drafter(target, num_layers=2)
    assert drafter.lm_head.weight is drafter.model.embed_tokens.weight
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight)


def test_training_lowers_kl_on_the_training_sequences(target, tok):
    settings = DistillSettings(num_layers=2, **dict(SMALL, steps=15))
    engine = Engine(target, tok)
    sequences = [ids + new for ids, new in target_sequences(engine, TRAIN_PROMPTS, settings.new_tokens)]
    examples = []
    for seq in sequences:
        ids = torch.tensor(seq)
        examples.append((ids, *teacher_top_logprobs(target, ids, settings.top_k_logprobs)))
    drafter = build_shallow_drafter(target, num_layers=2)
    kl_before = kl_per_token(target, drafter, sequences)
    losses, _ = train(drafter, examples, settings)
    kl_after = kl_per_token(target, drafter, sequences)
    assert len(losses) == 15
    assert kl_after < kl_before
    assert not drafter.training and all(p.requires_grad for p in drafter.parameters())
    # the embeddings and LM head were frozen: still the target's
    assert torch.equal(drafter.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight)


def test_distill_report_and_files(distilled):
    out, report = distilled
    assert report.layer_indices == [0, 3]
    assert report.train_steps == 4 and report.num_train_sequences == 4 and report.num_heldout_prompts == 2
    assert report.before.lossless and report.after.lossless
    assert report.before.drafted_tokens > 0 and report.after.drafted_tokens > 0
    assert 0.0 <= report.after.alpha <= 1.0 and report.after.tau >= 1.0
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["target"] == "tiny" and saved["layer_indices"] == [0, 3]
    assert saved["settings"]["steps"] == 4
    assert set(saved["before"]) >= {"alpha", "tau", "kl_nats_per_token"}
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_saved_drafter_loads_and_is_lossless_against_the_target(distilled, target, tok):
    out, _ = distilled
    model, loaded_tok = load_model(out)
    assert model.config.num_hidden_layers == 2
    assert loaded_tok.get_vocab() == tok.get_vocab()
    plain = Engine(target, tok)
    for prompt in HELDOUT_PROMPTS + TRAIN_PROMPTS[:1]:
        drafter = build_drafter("draft-model", model=model, tokenizer=loaded_tok, k=5)
        spec = Engine(target, tok, drafter=drafter).generate(prompt, max_new_tokens=24, draft_k=5)
        assert spec.token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
        assert spec.acceptance.drafted_tokens > 0


def test_save_load_round_trip_gives_identical_logits(target, tok, tmp_path):
    drafter = build_shallow_drafter(target, num_layers=2)
    with torch.no_grad():
        drafter.model.norm.weight.mul_(1.5)  # no longer just the target's weights
    save_drafter(drafter, tok, tmp_path)
    loaded, _ = load_model(tmp_path)
    ids = torch.tensor([[1, 5, 17, 33, 8, 60]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, drafter(input_ids=ids).logits)


@pytest.mark.parametrize(
    "bad",
    [
        dict(steps=0),
        dict(lr=0.0),
        dict(lr=-1e-4),
        dict(lr=float("nan")),
        dict(num_layers=0),
        dict(batch_size=0),
        dict(seq_len=1),
        dict(max_minutes=0),
        dict(num_prompts=0),
        dict(steps=True),
        dict(layer_indices=()),
    ],
)
def test_bad_settings_raise_config_error(bad):
    with pytest.raises(ConfigError):
        DistillSettings(**bad)


@pytest.mark.parametrize(
    "layers",
    [
        dict(num_layers=4),
        dict(num_layers=9),
        dict(layer_indices=[0, 0]),
        dict(layer_indices=[4]),
        dict(layer_indices=[-1]),
        dict(layer_indices=[0, 1, 2, 3]),
    ],
)
def test_bad_layer_choice_raises_config_error(target, layers):
    with pytest.raises(ConfigError):
        build_shallow_drafter(target, **layers)


def test_bad_output_dir_is_refused_before_any_work(target, tok, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    for out in (a_file, busy):
        with pytest.raises(ConfigError, match="directory"):
            distill_drafter(
                target,
                tok,
                out,
                DistillSettings(num_layers=2, **SMALL),
                progress=False,
                train_prompts=TRAIN_PROMPTS,
                heldout_prompts=HELDOUT_PROMPTS,
            )
    assert (busy / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError):
        distill_drafter(target, tok, tmp_path / "new", DistillSettings(num_layers=4), progress=False)


def test_default_prompts_hold_out_one_prompt_per_category():
    from fastdecode.data.suite import builtin_suite

    train_prompts, heldout = default_prompts(40)
    assert len(train_prompts) == 40 and len(heldout) == len({s.category for s in builtin_suite()})
    for prompt in heldout:
        assert not any(prompt[:80] in t for t in train_prompts)


def test_cli_distills_a_model_directory(target, tok, tmp_path, capsys):
    model_dir = tmp_path / "target"
    target.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "drafter"
    args = parser.parse_args(
        [
            "distill-drafter",
            "--model",
            str(model_dir),
            "--out",
            str(out),
            "--layer-indices",
            "0,2",
            "--steps",
            "2",
            "--num-prompts",
            "2",
            "--new-tokens",
            "8",
            "--eval-new-tokens",
            "8",
            "--seq-len",
            "64",
            "--no-progress",
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "after" in printed and "alpha" in printed
    assert json.loads((out / REPORT_FILE).read_text())["layer_indices"] == [0, 2]
    bad = parser.parse_args(["distill-drafter", "--out", str(tmp_path / "x"), "--layer-indices", "0,a"])
    with pytest.raises(ConfigError):
        args.func(bad)


def test_truncated_kl_is_the_kl_with_the_whole_vocabulary_and_a_lower_bound_without():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(3, 7, VOCAB) * 3, torch.randn(3, 7, VOCAB) * 3
    log_p, log_q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    full = (log_p.exp() * (log_p - log_q)).sum(-1)  # [3, 7]
    values, ids = log_p.topk(VOCAB, dim=-1)
    torch.testing.assert_close(truncated_kl(q_logits, values, ids), full)
    values, ids = log_p.topk(5, dim=-1)
    coarse = truncated_kl(q_logits, values, ids)
    assert (coarse >= -1e-6).all() and (coarse <= full + 1e-5).all()
