"""KV policies (fastdecode.kv.policy): sinks past the context window, H2O's heavy hitters,
shared blocks never written, speculation token-identical to plain decoding under each policy,
and the sampled distribution kept (with a negative control)."""

from __future__ import annotations

import pytest
import torch
from paged_helpers import moved_and_direct
from stats_helpers import binned_chisquare_pvalue, generate_per_seed
from tiny_models import tiny_llama

from fastdecode import Engine, GenerationConfig, build_drafter
from fastdecode.args import EngineArgs
from fastdecode.backends import make_target
from fastdecode.backends.base import BatchEntry
from fastdecode.backends.native import NativeTarget
from fastdecode.decoding.sampling import SamplingParams, probabilities
from fastdecode.errors import ConfigError
from fastdecode.evaluation.kv_policies import PolicySequence, evaluate_policies
from fastdecode.kv.attention import AttentionObserver
from fastdecode.kv.cache import BlockTable
from fastdecode.kv.policy import KVPolicy, compact, h2o_scores

CONTEXT = 64  # a small context window, so generations cross it
PROMPT = [1] + [20, 21, 22, 23] * 5
POLICIES = ["sinks", "sinks:0", "sinks:4,24", "h2o:0.4", "h2o:20"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(max_position_embeddings=CONTEXT, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def plain(model, tokenizer, policy: str, max_new: int = 150, **engine_kw):
    return Engine(model, tokenizer, **engine_kw).generate(PROMPT, max_new_tokens=max_new, kv_policy=policy)


# ---------------------------------------------------------------- parsing and refusals


def test_policy_strings_parse_and_bad_ones_are_one_clear_error():
    assert KVPolicy.parse("sinks") == KVPolicy("sinks", 4)
    assert KVPolicy.parse("sinks:2,100") == KVPolicy("sinks", 2, 100)
    assert KVPolicy.parse("h2o:0.2,0.25") == KVPolicy("h2o", budget=0.2, recent=0.25)
    assert KVPolicy.parse("h2o").budget == 0.2
    assert KVPolicy.parse("h2o:0.2,0.1,2,8") == KVPolicy("h2o", sinks=2, budget=0.2, recent=0.1, evict_tokens=8)
    state = KVPolicy.parse("h2o").new_state(512, 16)  # 102 slots in every lane: 4 sinks, 51 recent, 4 dropped at a time
    assert (state.capacity, state.keep_first, state.recent, state.evict_tokens) == (102, 4, 51, 4)
    assert KVPolicy.parse("sinks").new_state(64, 16).capacity == 64  # the rest of the context is the window
    for bad in ["lru", "sinks:x", "h2o:1.5", "h2o:0.2,2", "sinks:4,1", "full:3"]:
        with pytest.raises(ConfigError):
            KVPolicy.parse(bad)
    with pytest.raises(ConfigError, match="does not fit"):
        KVPolicy.parse("sinks:4,100").new_state(64, 16)


def test_the_transformers_target_refuses_policies_clearly(model, tokenizer):
    with pytest.raises(ConfigError, match="full cache"):
        Engine(model, tokenizer, target=make_target(model, "hf")).generate(PROMPT, max_new_tokens=2, kv_policy="sinks")
    with pytest.raises(ConfigError, match="transformers"):
        EngineArgs(backend="hf", kv_policy="sinks").validate()
    with pytest.raises(ConfigError):
        EngineArgs(kv_policy="bogus").validate()


# ---------------------------------------------------------------- sinks


def test_sinks_go_past_the_context_window_where_the_full_cache_stops(model, tokenizer):
    full = plain(model, tokenizer, "full")
    assert full.finish_reason == "context" and len(PROMPT) + len(full.token_ids) == CONTEXT
    sinks = plain(model, tokenizer, "sinks")
    assert sinks.finish_reason == "length" and len(PROMPT) + len(sinks.token_ids) > 2 * CONTEXT
    assert sinks.token_ids[: len(full.token_ids)] == full.token_ids  # nothing is evicted before the window is full


def test_sinks_keep_exactly_the_sink_tokens_and_the_recent_window(model, tokenizer):
    engine = Engine(model, tokenizer, drafter=build_drafter("ngram"), block_size=4)
    request = engine.get_request(engine.add_request(PROMPT, max_new_tokens=120, kv_policy="sinks:4,24"))
    S, W, E = 4, 24, 4
    evicted = False
    while engine.has_unfinished():
        engine.step()
        kv = request.kv
        T = kv.num_committed
        window = kv.kept_positions()[S:]
        assert kv.kept_positions()[:S] == list(range(S))
        assert window == list(range(T - len(window), T))  # the most recent, in order
        assert len(window) <= W and (T <= S + W or len(window) >= W - E)
        if not request.finished:  # evicted blocks went back to the pool
            assert len(request.table.blocks) == -(-kv.num_kept // 4)
        evicted |= kv.num_evicted > 0
    assert evicted and request.finish_reason == "length"
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_a_moved_key_is_the_key_written_at_its_new_slot(model):
    """Positions within the cache: keys re-rotated by their move equal keys rotated at the new slot
    (layer 0's keys depend only on the token and its slot)."""
    moved, direct, table = moved_and_direct(NativeTarget(model))
    got = moved.k[0][table.blocks].transpose(1, 2).reshape(-1, *moved.k[0].shape[1::2])[:7]
    want = direct.k[0][[0, 1]].transpose(1, 2).reshape(-1, *direct.k[0].shape[1::2])[:7]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(table.blocks) == 2 and moved.pool.num_free == 2


# ---------------------------------------------------------------- H2O


def test_h2o_keeps_the_heavy_hitters_of_a_hand_made_pattern():
    state = KVPolicy.parse("h2o:8,0.5,0,2").new_state(64, 2)  # 8 slots: 4 recent, no sinks, 2 evicted at a time
    assert (state.capacity, state.recent, state.evict_tokens, state.keep_first) == (8, 4, 2, 0)
    attention = torch.zeros(8, 1, 1, 8, dtype=torch.float64)  # [rows, layers, KV, slots]: rows look at slots 1, 2
    attention[..., 1], attention[..., 2], attention[..., 0] = 0.5, 0.3, 0.01
    state.pending_start, state.pending = 0, [attention]
    state.accept(8)
    assert state.keep().tolist() == [[[1, 2, 4, 5, 6, 7]]]  # the two least attended of slots 0..3 go: 0 and 3
    state.evicted(state.keep())
    assert state.kept_positions() == [1, 2, 4, 5, 6, 7]
    assert state.scores[0, 0, :2].tolist() == [4.0, 2.4]  # scores travel with their tokens


def test_h2o_keeps_heavy_hitters_per_layer_and_head():
    """Each (layer, KV head) lane keeps its own heavy hitters; every lane keeps the sinks, the
    recent window and the same number of slots."""
    state = KVPolicy.parse("h2o:10,0.3,1,2").new_state(64, 2)  # 1 sink, 3 recent, 2 evicted at a time
    attention = torch.zeros(10, 2, 2, 10, dtype=torch.float64)  # [rows, layers, KV, slots]
    for lane, hitters in enumerate([(1, 2), (3, 4), (5, 6), (2, 5)]):  # each lane looks at two slots
        attention[:, lane // 2, lane % 2, list(hitters)] = 0.4
    state.pending_start, state.pending = 0, [attention]
    state.accept(10)
    keep = state.keep()
    state.evicted(keep)
    # slots 1..6 compete; each lane drops the first two it did not look at (ties: the older first)
    assert [state.kept_positions(layer, head) for layer in (0, 1) for head in (0, 1)] == [
        [0, 1, 2, 5, 6, 7, 8, 9],
        [0, 3, 4, 5, 6, 7, 8, 9],
        [0, 3, 4, 5, 6, 7, 8, 9],
        [0, 2, 4, 5, 6, 7, 8, 9],
    ]


def test_h2o_scores_are_mean_attention_over_the_rows_that_saw_a_token():
    """A late token that every row looks at outranks an early one whose raw sum is larger only
    because more rows saw it."""
    state = KVPolicy.parse("h2o:6,0.34,0,1").new_state(64, 16)  # 2 recent, 1 evicted at a time
    attention = torch.zeros(6, 1, 1, 6, dtype=torch.float64)
    attention[:, ..., 0] = 0.2  # slot 0: seen by 6 rows, 1.2 in all, 0.2 a row
    attention[3:, ..., 3] = 0.3  # slot 3: seen by 3 rows, 0.9 in all, 0.3 a row
    attention[1:, ..., 1] = 0.25  # slot 1: 1.25 in all over 5 rows
    attention[2:, ..., 2] = 0.26  # slot 2: 1.04 over 4 rows
    state.pending_start, state.pending = 0, [attention]
    state.accept(6)
    assert torch.allclose(h2o_scores(state)[0, 0, :4], torch.tensor([0.2, 0.25, 0.26, 0.3], dtype=torch.float64))
    assert state.keep().tolist() == [[[1, 2, 3, 4, 5]]]  # a raw sum would drop slot 3 (0.9)
    assert KVPolicy.parse("h2o:6,0.34,1").new_state(64, 1).keep_first == 1


def test_a_lane_moves_alone_and_its_keys_are_written_at_their_new_slots(model):
    """Per-lane compaction: in layer 0 each KV head keeps other tokens; every moved key equals the
    key of its token written at its new slot in that head (layer 0's keys depend only on token and slot)."""
    target = NativeTarget(model)
    tokens = [5, 9, 13, 40, 41, 42, 7, 8]
    cache = target.new_kv_cache(4, 4)
    table = BlockTable(cache.pool.allocate(2))
    target.forward_batch(cache, [BatchEntry(tokens, 0, table.blocks, 1)])
    n_layers, kv_heads = len(cache.k), cache.k[0].shape[1]
    keep = torch.tensor([[0, 2, 3, 5, 7], [1, 2, 4, 6, 7]])[None].expand(n_layers, kv_heads, 5)
    before = [k.clone() for k in cache.k[1:]]
    compact(target, cache, table, keep.clone())
    assert len(table.blocks) == 2 and cache.pool.num_free == 2
    for head, kept in enumerate(keep[0].tolist()):
        direct = target.new_kv_cache(4, 4)
        target.forward_batch(direct, [BatchEntry([tokens[s] for s in kept], 0, [0, 1], 1)])
        got = cache.k[0][table.blocks][:, head].reshape(-1, cache.k[0].shape[-1])[:5]
        want = direct.k[0][[0, 1]][:, head].reshape(-1, cache.k[0].shape[-1])[:5]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(cache.k[1], before[0])  # the other layers moved too, by their own lanes


def test_every_h2o_lane_keeps_its_sinks_and_recent_window_and_evicted_blocks_go_back(model, tokenizer):
    engine = Engine(model, tokenizer, block_size=4)
    request = engine.get_request(engine.add_request(PROMPT, max_new_tokens=100, kv_policy="h2o:24,0.5"))
    while engine.has_unfinished():
        engine.step()
        kv = request.kv
        if not request.finished:
            assert len(request.table.blocks) == -(-kv.num_kept // 4) and kv.num_kept <= 24
    lanes = {tuple(kv.kept_positions(layer, head)) for layer in range(2) for head in range(2)}
    assert kv.num_evicted > 0 and kv.positions.shape[:2] == (2, 2)  # a kept set per layer and KV head
    assert all(lane[:4] == (0, 1, 2, 3) for lane in lanes)  # the sinks
    assert all(lane[-12:] == tuple(range(kv.num_committed - 12, kv.num_committed)) for lane in lanes)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_rejected_rows_never_change_the_h2o_scores():
    state = KVPolicy.parse("h2o:8,0.5,0").new_state(64, 2)
    rows = torch.ones(3, 1, 1, 4, dtype=torch.float64)  # a pass of 3 rows: only the first is accepted
    state.pending_start, state.pending = 0, [rows]
    state.accept(1)
    assert state.scores.tolist() == [[[1.0]]]


def test_the_attention_observer_is_softmax_of_the_queries_and_keys():
    torch.manual_seed(0)
    H, KV, D, B = 4, 2, 8, 4
    k_pool = torch.randn(3, KV, B, D)
    q = torch.randn(2, H, D)
    q[1, :, :] = 0
    q[1, :, 0] = 50.0  # row 1 looks hard at the slot whose key has the largest first component:
    k_pool[2, :, 3, 0] = 5.0  # slot 3 (block 2, offset 3) in every KV head
    entry = BatchEntry([7, 8], 4, [2, 0], 2, attention=[])  # slots 4, 5 of blocks [2, 0]
    observer = AttentionObserver([entry], [0], B, 0.5)
    observer(q, k_pool, None)
    observer.deliver()
    got = entry.attention[0][:, 0]  # [2 rows, 1 layer, KV, 6 slots]
    keys = torch.cat([k_pool[2], k_pool[0]], dim=1)[:, :6]  # [KV, slots, D]
    for i, p in enumerate((4, 5)):
        w = torch.softmax(q[i].view(KV, 2, D).double() @ keys[:, : p + 1].double().transpose(1, 2) * 0.5, -1)
        torch.testing.assert_close(got[i, :, : p + 1], w.amax(1))  # the largest over a KV head's query heads
    assert got[1].argmax(-1).tolist() == [3, 3] and float(got[1, :, 3].min()) > 0.99
    v_pool = torch.randn(3, KV, B, D)
    weighted = BatchEntry([7, 8], 4, [2, 0], 2, attention=[])
    observer = AttentionObserver([weighted], [0], B, 0.5)
    observer(q, k_pool, None, v_pool)  # VATP: each weight times its token's value norm
    observer.deliver()
    norms = torch.cat([v_pool[2], v_pool[0]], dim=1)[:, :6].double().norm(dim=-1)  # [KV, slots]
    torch.testing.assert_close(weighted.attention[0][:, 0], got * norms)


def test_h2o_requests_leave_their_batch_mates_bits_alone(model, tokenizer):
    alone = plain(model, tokenizer, "full", max_new=30)
    engine = Engine(model, tokenizer, max_num_seqs=2)
    outs = engine.generate([PROMPT, PROMPT[:-3]], max_new_tokens=30, kv_policy="h2o:0.5")
    mixed = Engine(model, tokenizer, max_num_seqs=2)
    full_id = mixed.add_request(PROMPT, max_new_tokens=30)
    h2o_id = mixed.add_request(PROMPT[:-3], max_new_tokens=30, kv_policy="h2o:0.5")
    full_req, h2o_req = mixed.get_request(full_id), mixed.get_request(h2o_id)
    while mixed.has_unfinished():
        mixed.step()
    assert full_req.new_tokens == alone.token_ids
    assert h2o_req.new_tokens == outs[1].token_ids


# ---------------------------------------------------------------- prefix sharing


def test_a_shared_block_is_copied_never_written(model, tokenizer):
    """Request A (full) registers its prompt's blocks; B (sinks) takes them from the prefix cache
    while A still runs, then evicts: A's output and the cached blocks are untouched."""
    prompt = list(range(3, 36))  # two full blocks of 16 and one token
    alone = Engine(model, tokenizer).generate(prompt, max_new_tokens=20)
    engine = Engine(model, tokenizer, max_num_seqs=2)
    a = engine.get_request(engine.add_request(prompt, max_new_tokens=20))
    engine.step()  # A's prompt is in, its blocks registered
    shared = list(a.table.blocks[:2])
    before = [(k[shared].clone(), v[shared].clone()) for k, v in zip(engine.kv_cache.k, engine.kv_cache.v)]
    b = engine.get_request(engine.add_request(prompt, max_new_tokens=60, kv_policy="sinks:4,36"))
    engine.step()
    assert b.num_cached_tokens == 32 and b.table.blocks[:2] == shared  # B holds A's blocks
    while engine.has_unfinished():
        engine.step()
        assert all(blk not in b.table.blocks for blk in shared) or b.kv.num_evicted == 0
    assert b.kv.num_evicted > 0  # it evicted (the shared blocks included) before it stopped
    assert a.new_tokens == alone.token_ids
    for (k0, v0), k, v in zip(before, engine.kv_cache.k, engine.kv_cache.v):
        assert torch.equal(k[shared], k0) and torch.equal(v[shared], v0)
    hits = engine.block_pool.prefix_hits_tokens
    again = engine.generate(prompt, max_new_tokens=20)
    assert engine.block_pool.prefix_hits_tokens == hits + 32 and again.token_ids == alone.token_ids
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


# ---------------------------------------------------------------- speculation under a policy


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("drafter", ["ngram", "oracle", "draft-model"])
def test_speculative_greedy_is_token_identical_to_plain_under_the_policy(
    model, tokenizer, oracle_drafter, policy, drafter, linear_pass_costs
):  # (fixed pass costs: whether a draft pays must not hang on this machine's timing)
    reference = plain(model, tokenizer, policy, max_new=110)
    assert len(reference.token_ids) > CONTEXT  # past the window: evictions happened
    if drafter == "oracle":  # long accepted drafts with known rejections, across eviction points
        built = oracle_drafter(PROMPT + reference.token_ids, corrupt=lambda step, i: (step + i) % 5 == 4)
    elif drafter == "draft-model":
        built = build_drafter("draft-model", model=tiny_llama(1, max_position_embeddings=CONTEXT), k=4)
    else:
        built = build_drafter("ngram")
    engine = Engine(model, tokenizer, drafter=built)
    out = engine.generate(PROMPT, max_new_tokens=110, kv_policy=policy, draft_k=6)
    assert out.token_ids == reference.token_ids
    if drafter != "draft-model":  # (a draft model with a full cache of its own stops drafting at its context)
        assert out.acceptance.accepted_tokens > 0


def test_speculative_sampling_keeps_the_policy_targets_distribution(model, tokenizer):
    """The second sampled token comes after an eviction (the prompt fills the 32-slot cache);
    its marginal, computed exactly with the policy's own code on one sequence, is what a draft
    model's rejection sampling yields. Negative control: a distribution off by 0.15 is rejected."""
    policy, prompt = "sinks:4,28", list(range(30, 62))
    params = SamplingParams(temperature=1.0, top_k=6)
    target = NativeTarget(model)

    def next_p(tokens):
        return probabilities(PolicySequence(target, policy, CONTEXT, 4).feed(tokens)[-1:], params)[0]

    p1 = next_p(prompt)
    firsts = p1.nonzero()[:, 0].tolist()
    marginal2 = sum(float(p1[a]) * next_p([*prompt, a]) for a in firsts)
    draft = build_drafter("draft-model", model=tiny_llama(1, max_position_embeddings=CONTEXT), k=3)
    engine = Engine(model, tokenizer, drafter=draft, block_size=4, max_num_seqs=100)
    config = GenerationConfig(max_new_tokens=4, draft_k=3, kv_policy=policy, sampling=params)
    seconds, accepted = [], 0
    for result in generate_per_seed(engine, prompt, config, range(600)):
        assert len(result.token_ids) >= 2
        seconds.append(result.token_ids[1])  # the second token: drafted and verified
        accepted += result.acceptance.accepted_tokens
    assert accepted > 0
    assert binned_chisquare_pvalue(seconds, marginal2) > 0.001
    wrong = marginal2.clone()
    wrong[int(marginal2.argmax())] += 0.15
    assert binned_chisquare_pvalue(seconds, wrong) < 0.001


# ---------------------------------------------------------------- the evaluation


def test_policy_perplexity_runs_every_mode_on_the_same_positions(model):
    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    results = evaluate_policies(NativeTarget(model), ids, 64)  # h2o:0.2 keeps 12 slots: 4 sinks, 6 recent
    assert [r.mode for r in results] == ["full", "sinks", "window", "h2o:0.2", "h2o:0.5"]
    assert all(r.tokens_scored == 199 and 1 < r.perplexity < 1000 for r in results)


@pytest.mark.parametrize("policy", ["sinks:4,28", "h2o:24"])
def test_a_prompt_longer_than_the_context_is_evicted_while_it_is_prefilled(model, tokenizer, policy):
    """Evictions fall at the same tokens however the prompt is chunked: the output is the same
    with 256-row and 5-row passes, and with a drafter."""
    prompt = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(1)).tolist()  # > CONTEXT
    one = Engine(model, tokenizer).generate(prompt, max_new_tokens=40, kv_policy=policy)
    chunked = Engine(model, tokenizer, max_num_batched_tokens=5, max_num_seqs=1).generate(
        prompt, max_new_tokens=40, kv_policy=policy
    )
    drafted = Engine(model, tokenizer, drafter=build_drafter("ngram")).generate(
        prompt, max_new_tokens=40, kv_policy=policy
    )
    assert len(one.token_ids) == 40 or one.finish_reason == "eos"
    assert chunked.token_ids == one.token_ids == drafted.token_ids
    with pytest.raises(Exception, match="context"):
        Engine(model, tokenizer).generate(prompt, max_new_tokens=4)  # the full cache refuses it


@pytest.mark.parametrize("policy", ["sinks", "h2o:0.5"])
def test_the_evaluation_runs_the_engines_policy(model, tokenizer, policy):
    """PolicySequence (kv_eval, and the distribution test's reference) decodes greedily what the engine does."""
    reference = plain(model, tokenizer, policy, max_new=90)
    seq = PolicySequence(NativeTarget(model), policy, CONTEXT)
    logits, tokens = seq.feed(PROMPT), []
    while len(tokens) < len(reference.token_ids):
        tokens.append(int(logits[-1].argmax()))
        logits = seq.feed(tokens[-1:])
    assert tokens == reference.token_ids


def test_the_evaluation_command_prints_every_mode(tmp_path, capsys, short_evaluation_text):
    from tiny_models import save_tiny_llama

    from fastdecode.evaluation.kv_policies import main, split_modes

    model_dir = save_tiny_llama(tmp_path / "tiny")
    assert main(["--model", str(model_dir), "--window", "64", "--tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "200 tokens, window 64 (3.1x)" in out
    assert all(f"\n{mode} " in out for mode in ("full", "sinks", "window", "h2o:0.2", "h2o:0.5"))
    text = tmp_path / "short.txt"  # (not the built-in text again: the mode is refused whatever is scored)
    text.write_text("a short text to score\n" * 4, encoding="utf-8")
    assert main(["--model", str(model_dir), "--window", "32", "--modes", "lru", "--text", str(text)]) == 2
    assert "lru" in capsys.readouterr().err
    assert split_modes("full,h2o:0.2,0.5,4,1, sinks:4,20") == ["full", "h2o:0.2,0.5,4,1", "sinks:4,20"]


def test_the_evaluation_command_scores_another_text(tmp_path, capsys):
    from tiny_models import save_tiny_llama

    from fastdecode.evaluation.kv_policies import main

    model_dir = save_tiny_llama(tmp_path / "tiny")
    text = tmp_path / "verse.txt"
    text.write_text("Before we proceed any further, hear me speak.\n" * 40, encoding="utf-8")
    assert (
        main(["--model", str(model_dir), "--window", "32", "--tokens", "80", "--modes", "sinks", "--text", str(text)])
        == 0
    )
    assert f"text {text}" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's usage error: a missing file
        main(["--model", str(model_dir), "--text", str(tmp_path / "none.txt")])


@pytest.mark.parametrize("policy", ["sinks", "h2o:0.5"])
def test_gemma3_local_and_global_ropes_go_past_the_context_losslessly(tokenizer, policy):
    from tiny_models import tiny_gemma3

    gemma = tiny_gemma3(max_position_embeddings=CONTEXT, eos_token_id=2)
    reference = Engine(gemma, tokenizer).generate(PROMPT, max_new_tokens=80, kv_policy=policy)
    drafted = Engine(gemma, tokenizer, drafter=build_drafter("ngram")).generate(
        PROMPT, max_new_tokens=80, kv_policy=policy
    )
    assert len(PROMPT) + len(reference.token_ids) > CONTEXT and drafted.token_ids == reference.token_ids


def test_a_rope_that_is_not_a_pure_rotation_is_refused():
    from fastdecode.kv.attention import check_rope_shift

    class Rotary:  # what a rotary module sets in its __init__
        def __init__(self, **scalings) -> None:
            vars(self).update(scalings)

    assert "scales cos and sin" in check_rope_shift(Rotary(attention_scaling=1.2))  # YaRN, LongRoPE
    assert "scales cos and sin" in check_rope_shift(Rotary(full_attention_attention_scaling=1.1))
    assert (
        check_rope_shift(Rotary(full_attention_attention_scaling=1.0, sliding_attention_attention_scaling=1.0)) is None
    )
