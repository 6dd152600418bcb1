"""Draft-model and layer-skip drafters on tiny random-weight models."""

import copy

import pytest
import torch
from stats_helpers import binned_chisquare_pvalue, generate_per_seed
from tiny_models import tiny_llama as build

from fastdecode import Engine, GenerationConfig, SamplingParams, build_drafter
from fastdecode.backends import HFTarget, NativeTarget, PagedSequence
from fastdecode.decoding.sampling import probabilities
from fastdecode.errors import ConfigError, IncompatibleDrafterError

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71]


def tiny_llama(seed, layers=2, vocab=96):
    return build(seed, vocab_size=vocab, num_hidden_layers=layers, eos_token_id=2, bos_token_id=1, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, layers=4)


@pytest.fixture(scope="module")
def plain(target, tokenizer):
    return Engine(target, tokenizer).generate(PROMPT, max_new_tokens=40)


def test_target_drafting_for_itself_accepts_everything(target, tokenizer, plain):
    drafter = build_drafter("draft-model", model=target, k=4)
    result = Engine(target, tokenizer, drafter=drafter).generate(PROMPT, max_new_tokens=40, draft_k=4)
    assert result.token_ids == plain.token_ids
    acc = result.acceptance
    assert acc.accepted_tokens == acc.drafted_tokens > 0
    assert acc.per_position_acceptance == [1.0] * 4


def test_only_the_targets_own_model_drafts_in_its_kv_cache(target, tokenizer):
    from fastdecode.kv.cache import BlockTable

    engine = Engine(target, tokenizer)
    cache, table = engine._cache(), BlockTable()
    assert build_drafter("draft-model", model=target, k=3).attach_kv(engine.target, cache, table)
    # another model of the same shape: its K and V would not be the target's
    assert not build_drafter("draft-model", model=tiny_llama(9, layers=4), k=3).attach_kv(engine.target, cache, table)
    hf = Engine(target, tokenizer, target=HFTarget(target))  # no paged tensors to draft in
    assert not build_drafter("draft-model", model=target, k=3).attach_kv(hf.target, hf._cache(), table)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_the_prompt_is_prefilled_at_begin_so_a_draft_feeds_only_what_is_new(target, backend):
    drafter = build_drafter("draft-model", model=tiny_llama(7), k=3, backend=backend)
    fed = []
    forward = drafter.draft.forward
    drafter.draft.forward = lambda ids, n: fed.append(list(ids)) or forward(ids, n)
    drafter.begin(PROMPT)
    assert fed == [PROMPT[:-1]] and drafter.draft.cache_len == len(PROMPT) - 1
    first = drafter.propose(PROMPT, 3)
    assert fed[1:] == [PROMPT[-1:], first.tokens[:1], first.tokens[1:2]]  # no prompt token fed twice
    context = [*PROMPT, first.tokens[0], 5]  # one draft token accepted, then the target's own
    fed.clear()
    second = drafter.propose(context, 2)
    assert fed == [context[-1:], second.tokens[:1]]  # rolled back to the accepted draft token: only the target's is new
    # the same draft as a drafter that saw the whole context at once
    fresh = build_drafter("draft-model", model=tiny_llama(7), k=3, backend=backend)
    fresh.begin(context)
    assert fresh.propose(context, 2).tokens == second.tokens


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_different_draft_model_is_lossless(target, tokenizer, plain, backend, k):
    drafter = build_drafter("draft-model", model=tiny_llama(7), k=k, backend=backend)
    result = Engine(target, tokenizer, drafter=drafter).generate(PROMPT, max_new_tokens=40, draft_k=k)
    assert result.token_ids == plain.token_ids
    assert result.acceptance.drafted_tokens > result.acceptance.accepted_tokens  # rollbacks happened


@pytest.mark.parametrize("options", [{"exit_layer": 1}, {"exit_layer": 3}, {"skip_layers": [1, 2]}])
def test_layer_skip_is_lossless_and_leaves_the_model_alone(target, tokenizer, plain, options):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = build_drafter("layer-skip", model=target, **options)
    result = Engine(target, tokenizer, drafter=drafter).generate(PROMPT, max_new_tokens=40, adaptive_k=True)
    assert result.token_ids == plain.token_ids
    assert target.config.num_hidden_layers == 4
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    assert Engine(target, tokenizer).generate(PROMPT, max_new_tokens=40).token_ids == plain.token_ids


def test_layer_skip_settings_are_checked(target):
    with pytest.raises(ConfigError, match="exit_layer"):
        build_drafter("layer-skip", model=target, exit_layer=4)
    with pytest.raises(ConfigError, match="skip_layers"):
        build_drafter("layer-skip", model=target, skip_layers=[0, 1, 2, 3])
    with pytest.raises(ConfigError, match="not both"):
        build_drafter("layer-skip", model=target, exit_layer=1, skip_layers=[2])


class _Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_mismatched_vocabularies_are_refused(target, tokenizer):
    target_tok = copy.copy(tokenizer)
    target_tok.get_vocab = lambda: {chr(65 + i): i for i in range(20)}
    other = _Vocab({chr(97 + i): i for i in range(20)})
    drafter = build_drafter("draft-model", model=tiny_llama(7), tokenizer=other)
    with pytest.raises(IncompatibleDrafterError, match="vocabulary does not match"):
        Engine(target, target_tok, drafter=drafter)


def test_draft_model_with_a_smaller_vocabulary_is_refused(target, tokenizer):
    drafter = build_drafter("draft-model", model=tiny_llama(7, vocab=80), k=3)
    with pytest.raises(IncompatibleDrafterError, match="80 token embeddings"):
        Engine(target, tokenizer, drafter=drafter)


def test_draft_model_with_a_padded_vocabulary_is_lossless(target, tokenizer, plain):
    drafter = build_drafter("draft-model", model=tiny_llama(7, vocab=128), k=3)
    result = Engine(target, tokenizer, drafter=drafter).generate(PROMPT, max_new_tokens=40)
    assert result.token_ids == plain.token_ids
    sampled = Engine(target, tokenizer, drafter=drafter).generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=3)
    assert all(t < 96 for t in sampled.token_ids)


def _three_tokens_sampled(engine, prompt, params, runs):
    """``runs`` generations of 3 tokens with K=2, seeds 0..runs-1: (their tokens, draft tokens accepted)."""
    results = generate_per_seed(
        engine, prompt, GenerationConfig(max_new_tokens=3, draft_k=2, sampling=params), range(runs)
    )
    return [r.token_ids for r in results], sum(r.acceptance.accepted_tokens for r in results)


def test_sampling_with_a_model_drafter_keeps_the_target_distribution(tokenizer):
    """q is a real distribution here (not one-hot). With 3 new tokens and K=2
    the second token is a draft token verified by rejection sampling (the first
    comes from prefill): tokens 1 and 2 follow the target's exact marginals
    (chi-square, alpha = 0.001, fixed seeds). The target is the engine's own (native, batched),
    100 requests a pass: the transformers target runs one sequence at a time, a pass per request
    and step (its logits are tests/backends' subject; rejection sampling is the engine's, whatever
    the target)."""
    target = tiny_llama(0)
    draft = copy.deepcopy(target)  # the target with a perturbed head: q near p, but not equal
    torch.manual_seed(5)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.02 * torch.randn_like(draft.lm_head.weight))
    params = SamplingParams(temperature=0.05, top_k=6)
    prompt = PROMPT
    with torch.no_grad():
        p1 = probabilities(target(torch.tensor([prompt])).logits[0, -1:], params)[0]
        firsts = p1.nonzero()[:, 0].tolist()
        p2 = probabilities(target(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1], params)
        q2 = probabilities(draft(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1], params)
    marginal2 = p1[firsts] @ p2  # [V]
    draft_marginal2 = p1[firsts] @ q2
    assert float((marginal2 - draft_marginal2).abs().sum()) > 0.3  # the drafter disagrees with the target

    engine = Engine(target, tokenizer, drafter=build_drafter("draft-model", model=draft, k=2), max_num_seqs=100)
    runs = 1500
    outputs, accepted = _three_tokens_sampled(engine, prompt, params, runs)
    assert accepted > runs * 0.3
    assert binned_chisquare_pvalue([o[0] for o in outputs], p1) > 0.001
    assert binned_chisquare_pvalue([o[1] for o in outputs], marginal2) > 0.001
    # negative control: the drafter's own distribution is rejected by the same test
    assert binned_chisquare_pvalue([o[1] for o in outputs], draft_marginal2) < 0.001


def test_native_target_subset_uses_only_its_layers(target):
    full, half = NativeTarget(target), NativeTarget(target, layers=[0, 1])
    assert len(full.layers) == 4 and len(half.layers) == 2
    assert not torch.allclose(PagedSequence(full).forward(PROMPT, 1), PagedSequence(half).forward(PROMPT, 1))


def test_hybrid_drafts_long_ngram_matches_itself_and_the_model_elsewhere(target, tokenizer):
    prompt = [1] + [20, 21, 22, 23, 24, 25] * 4  # a repeating prompt: the memory has 5-gram matches
    plain = Engine(target, tokenizer).generate(prompt, max_new_tokens=40)
    drafter = build_drafter("hybrid", model=tiny_llama(7), k=4)
    by_model = []
    propose = drafter.model_drafter.propose
    drafter.model_drafter.propose = lambda context, k: by_model.append(len(context)) or propose(context, k)
    drafter.set_sampling(SamplingParams(), None)
    drafter.begin(prompt)
    from_memory = drafter.propose(prompt, 4)  # the prompt's last 4 tokens were seen before, followed by 20, 21, ..
    assert from_memory.tokens == [20, 21, 22, 23] and from_memory.q is None and by_model == []
    assert drafter.propose([1, 90, 91, 92], 3).tokens and by_model == [4]  # nothing matched: the model drafts
    result = Engine(target, tokenizer, drafter=build_drafter("hybrid", model=tiny_llama(7), k=4)).generate(
        prompt, max_new_tokens=40
    )
    assert result.token_ids == plain.token_ids and result.acceptance.drafted_tokens > 0


def test_hybrid_samples_only_from_the_model(target, tokenizer):
    drafter = build_drafter("hybrid", model=tiny_llama(7), k=3)
    drafter.set_sampling(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    prompt = [1] + [20, 21, 22, 23, 24, 25] * 4
    drafter.begin(prompt)
    draft = drafter.propose(prompt, 3)
    assert draft.q is not None and draft.q.shape[0] == len(draft)  # rejection sampling needs q for every token
    with pytest.raises(ConfigError, match="min_order"):
        build_drafter("hybrid", model=tiny_llama(7), n=4, min_order=5)


def test_sampling_with_the_targets_own_blocks_in_its_kv_cache_keeps_the_target_distribution(tokenizer):
    """As above, with the target's own Q4_0 blocks drafting in the engine's paged cache (its
    q then comes from the target's K and V of the prompt and its own row): tokens 1 and 2
    follow the target's marginals; a Q4_0 copy with a cache of its own shows the drafter's
    distribution is far from the target's at this temperature."""
    from fastdecode.backends import make_target
    from fastdecode.drafters.factory import DrafterOptions

    target = tiny_llama(0)
    params = SamplingParams(temperature=0.05, top_k=6)
    native, q4 = make_target(target, "native"), make_target(target, "native", "q4_0")

    def dist(executor, rows):
        out = []
        for row in rows:
            out.append(probabilities(PagedSequence(executor).forward(row, 1), params)[0])
        return torch.stack(out)

    p1 = dist(native, [PROMPT])[0]
    firsts = p1.nonzero()[:, 0].tolist()
    marginal2 = p1[firsts] @ dist(native, [PROMPT + [a] for a in firsts])
    draft_marginal2 = p1[firsts] @ dist(q4, [PROMPT + [a] for a in firsts])
    assert float((marginal2 - draft_marginal2).abs().sum()) > 0.1  # the drafter disagrees with the target

    drafter = DrafterOptions(name="draft-model", k=2, draft_quant="q4_0").build(target, tokenizer)
    own = []
    drafter.draft.forward = lambda *a: own.append(a)  # a cache of its own: not used
    engine = Engine(target, tokenizer, drafter=drafter, target=native)
    runs = 1500
    outputs, accepted = _three_tokens_sampled(engine, PROMPT, params, runs)
    assert own == []  # it drafted in the target's cache
    assert runs * 0.3 < accepted
    assert binned_chisquare_pvalue([o[0] for o in outputs], p1) > 0.001
    assert binned_chisquare_pvalue([o[1] for o in outputs], marginal2) > 0.001
    assert binned_chisquare_pvalue([o[1] for o in outputs], draft_marginal2) < 0.001


def test_a_cache_the_drafters_kernels_cannot_take_keeps_a_cache_of_its_own(target, tokenizer):
    from fastdecode.backends import make_target
    from fastdecode.drafters.factory import DrafterOptions

    bf16 = make_target(target, "native", "float", "torch", "bfloat16")  # torch's kernels, a bfloat16 cache
    plain = Engine(target, tokenizer, target=bf16).generate(PROMPT, max_new_tokens=24)
    drafter = DrafterOptions(name="draft-model", k=3, draft_quant="q4_0").build(target, tokenizer)
    own = []
    forward = drafter.draft.forward
    drafter.draft.forward = lambda ids, n: own.append(len(ids)) or forward(ids, n)
    result = Engine(target, tokenizer, drafter=drafter, target=bf16).generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == plain.token_ids and result.acceptance.drafted_tokens > 0
    assert own and own[0] == len(PROMPT) - 1  # its own float32 cache, prefilled: its kernels take float32 or float16
