"""Fuzzing the drafters, the verifier and the engine against their invariants.

Seeded (hypothesis, derandomized: the same examples every run) random token streams,
draft lengths and acceptance patterns:

* the n-gram and prompt-lookup drafters equal brute-force references written from their
  definitions, and their drafts stay within K and within the tokens they have seen;
* the verifiers accept exactly the longest matching draft prefix (greedy), never a token
  the target gives probability 0 (sampling), and draw no target token past the bonus;
* the engine's output equals plain decoding for random prompts, drafter settings and
  batches on the tiny model (greedy and seeded sampling), accepts exactly the draft
  prefix an oracle drafter made right, and gives every KV block back.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdecode.backends import make_target
from fastdecode.decoding.verify import verify_by_matching, verify_greedy, verify_sampling
from fastdecode.drafters import build_drafter
from fastdecode.drafters.ngram import NGramDrafter
from fastdecode.drafters.prompt_lookup import PromptLookupDrafter, find_candidate_pred_tokens
from fastdecode.engine import Engine

FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
ENGINE_FUZZ = settings(FUZZ, max_examples=50)


# ---------------------------------------------------------------- references


def reference_query(history: list[int], tail: list[int], N: int, min_count: int, min_prob: float) -> int | None:
    """ANPD's multi-level query from its definition: for n = N..2, the successors of the last
    n - 1 tokens of ``tail`` everywhere in ``history``; the most frequent (a tie goes to the
    token that reached that count last) if it passes the gate."""
    for n in range(N, 1, -1):
        width = n - 1
        if len(tail) < width:
            continue
        key = tail[len(tail) - width :]
        counts: dict[int, int] = {}
        reached: dict[int, int] = {}
        for i in range(width, len(history)):
            if history[i - width : i] == key:
                token = history[i]
                counts[token] = counts.get(token, 0) + 1
                reached[token] = i
        if not counts:
            continue
        best_count = max(counts.values())
        best = max((t for t, c in counts.items() if c == best_count), key=reached.__getitem__)
        if best_count >= min_count and best_count / sum(counts.values()) >= min_prob:
            return best
    return None


def reference_draft(
    history: list[int], N: int, k: int, min_count: int, min_prob: float, tail: list[int] | None = None
) -> list[int]:
    """Up to k chained queries, each prediction appended to the tail (never to the history)."""
    tail, draft = list(history if tail is None else tail), []
    for _ in range(k):
        token = reference_query(history, tail, N, min_count, min_prob)
        if token is None:
            break
        draft.append(token)
        tail.append(token)
    return draft


def reference_lookup(context: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup from its definition: the earliest earlier occurrence of the longest
    matching tail n-gram that has a token after it; up to k tokens that followed it."""
    for size in range(max_ngram, min_ngram - 1, -1):
        if size > len(context) - 1:
            continue
        tail = context[len(context) - size :]
        for start in range(len(context) - size):
            if context[start : start + size] == tail:
                return context[start + size : start + size + k]
    return []


tokens_over = st.integers(1, 6).flatmap(lambda v: st.lists(st.integers(0, v - 1), max_size=50))


# ---------------------------------------------------------------- the n-gram drafter


@FUZZ
@given(tokens=tokens_over, data=st.data())
def test_ngram_drafter_equals_the_reference_as_the_context_grows(tokens, data):
    N = data.draw(st.integers(2, 6), "N")
    min_count = data.draw(st.integers(0, 3), "min_count")
    min_prob = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]), "min_prob")
    split = data.draw(st.integers(0, len(tokens)), "prompt length")
    drafter = NGramDrafter(n=N, k=7, min_count=min_count, min_prob=min_prob)
    context, rest = tokens[:split], tokens[split:]
    drafter.begin(torch.tensor(context, dtype=torch.long) if data.draw(st.booleans(), "tensor prompt") else context)
    while True:
        k = data.draw(st.integers(0, 10), "k")
        draft = drafter.propose(context, k)
        assert draft.q is None
        assert draft.tokens == reference_draft(context, N, k, min_count, min_prob)
        assert len(draft.tokens) <= k and set(draft.tokens) <= set(context)

        num_paths = data.draw(st.integers(1, 4), "paths")
        paths = drafter.propose_paths(torch.tensor(context, dtype=torch.long) if context else context, k, num_paths)
        assert paths.tokens == draft.tokens
        assert len(paths.alternatives) <= num_paths - 1
        branched = set()  # (depth, token) of each branch of the tree
        for alt in paths.alternatives:
            assert 1 <= len(alt) <= k and set(alt) <= set(context)
            d = next(i for i, t in enumerate(alt) if i >= len(draft.tokens) or t != draft.tokens[i])
            assert d < len(draft.tokens) and (d, alt[d]) not in branched  # another successor at a depth of the chain
            branched.add((d, alt[d]))
            assert alt[d + 1 :] == reference_draft(
                context, N, k - d - 1, min_count, min_prob, tail=context + alt[: d + 1]
            )
        if not rest:
            return
        n = data.draw(st.integers(1, len(rest)), "appended")
        new, rest = rest[:n], rest[n:]
        context = context + new
        drafter.observe(new, data.draw(st.integers(0, n - 1), "accepted"))


@FUZZ
@given(tokens=tokens_over, N=st.integers(2, 5), max_contexts=st.integers(1, 6), k=st.integers(0, 9))
def test_ngram_memory_bound_keeps_drafts_valid(tokens, N, max_contexts, k):
    drafter = NGramDrafter(n=N, k=max(k, 1), max_contexts=max_contexts)
    drafter.begin(tokens[:3])
    for i in range(3, len(tokens)):
        drafter.observe(tokens[i : i + 1], 0)
        draft = drafter.propose(tokens[: i + 1], k).tokens
        assert len(draft) <= k and set(draft) <= set(tokens[: i + 1])
        assert len(drafter.mln.table) <= max_contexts


@FUZZ
@given(tokens=tokens_over, k=st.integers(1, 8), persistent=st.booleans())
def test_ngram_forks_share_nothing_unless_persistent(tokens, k, persistent):
    drafter = NGramDrafter(n=3, k=k, persistent=persistent)
    drafter.begin(tokens)
    twin = drafter.fork()
    twin.begin([])
    expected = reference_draft(tokens, 3, k, 1, 0.0) if persistent else []
    assert twin.propose(tokens, k).tokens == expected


# ---------------------------------------------------------------- prompt lookup


@FUZZ
@given(context=tokens_over, k=st.integers(0, 10), sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)))
def test_prompt_lookup_equals_the_reference(context, k, sizes):
    min_ngram, extra = sizes
    max_ngram = min_ngram + extra
    found = find_candidate_pred_tokens(context, k, max_ngram, min_ngram)
    assert found == reference_lookup(context, k, max_ngram, min_ngram)
    assert len(found) <= k
    if found:  # a slice of the context that follows an earlier copy of some tail n-gram
        assert any(context[s : s + len(found)] == found for s in range(1, len(context)))
    drafter = PromptLookupDrafter(k=max(k, 1), max_ngram_size=max_ngram, min_ngram_size=min_ngram)
    assert drafter.propose(torch.tensor(context, dtype=torch.long), k).tokens == found


# ---------------------------------------------------------------- the verifier


drafts = st.integers(1, 5).flatmap(
    lambda v: st.tuples(
        st.just(v), st.lists(st.integers(0, v - 1), max_size=8), st.lists(st.integers(0, v - 1), min_size=9, max_size=9)
    )
)


@FUZZ
@given(drafts)
def test_verify_greedy_and_by_matching_accept_the_longest_matching_prefix(case):
    _, draft, target = case
    k = len(draft)
    target = target[: k + 1]
    n, bonus = verify_greedy(draft, torch.tensor(target))
    assert 0 <= n <= k
    assert draft[:n] == target[:n]
    assert n == k or draft[n] != target[n]
    assert bonus == target[n]

    asked: list[int] = []
    assert verify_by_matching(draft, lambda i: asked.append(i) or target[i]) == (n, bonus)
    assert asked == list(range(n + 1))  # no target token drawn past the bonus


@FUZZ
@given(case=drafts, seed=st.integers(0, 2**32 - 1), with_q=st.booleans(), zeros=st.floats(0.0, 0.6))
def test_verify_sampling_never_takes_a_token_the_target_rules_out(case, seed, with_q, zeros):
    vocab, draft, _ = case
    k = len(draft)
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=gen)
    p[torch.rand(k + 1, vocab, generator=gen) < zeros] = 0.0
    p[torch.arange(k + 1), torch.randint(vocab, (k + 1,), generator=gen)] += 0.1  # every row has some mass
    p = p / p.sum(-1, keepdim=True)  # [k + 1, vocab]
    q = None
    if with_q:
        q = torch.rand(k, vocab, generator=gen) + 1e-3
        q = q / q.sum(-1, keepdim=True)  # [k, vocab]
    n, token = verify_sampling(draft, p, q, torch.Generator().manual_seed(seed))
    assert 0 <= n <= k and 0 <= token < vocab
    assert all(p[i, draft[i]] > 0 for i in range(n))  # accepted draft tokens
    assert p[n, token] > 0  # the recovered or bonus token
    if n < k and q is None:
        assert token != draft[n]  # a one-hot q's residual excludes the rejected token
    assert verify_sampling(draft, p, q, torch.Generator().manual_seed(seed)) == (n, token)  # seeded: reproducible
    if k:  # a deterministic target (p one-hot) accepts exactly as greedy verification does
        onehot = torch.nn.functional.one_hot(p.argmax(-1), vocab).float()
        assert verify_sampling(draft, onehot, None, gen) == verify_greedy(draft, p.argmax(-1))


# ---------------------------------------------------------------- the engine on the tiny model


@pytest.fixture(scope="module")
def shared(tiny_model, tokenizer):
    """One target for every engine here (runs are sequential), and plain results by request."""
    target = make_target(tiny_model)
    plain = Engine(tiny_model, tokenizer, target=target)
    cache: dict[tuple, list[int]] = {}

    def plain_tokens(prompt: list[int], max_new_tokens: int, sampling: dict) -> list[int]:
        key = (tuple(prompt), max_new_tokens, tuple(sorted(sampling.items())))
        if key not in cache:
            cache[key] = plain.generate(prompt, max_new_tokens=max_new_tokens, **sampling).token_ids
        return cache[key]

    return tiny_model, tokenizer, target, plain_tokens


# Token ids of the character tokenizer (3..95): a narrow range makes repetitions, so drafts.
prompts = st.lists(st.integers(3, 12), min_size=1, max_size=48) | st.lists(st.integers(3, 95), min_size=1, max_size=24)


def _drafter(data):
    name = data.draw(st.sampled_from(["ngram", "prompt-lookup"]), "drafter")
    if name == "ngram":
        return build_drafter(
            "ngram", n=data.draw(st.integers(2, 6), "N"), k=7, min_count=data.draw(st.integers(1, 2), "min_count")
        )
    return build_drafter("prompt-lookup", max_ngram_size=data.draw(st.integers(1, 4), "max_ngram_size"))


@ENGINE_FUZZ
@given(data=st.data(), batch=st.lists(prompts, min_size=1, max_size=4))
def test_engine_output_equals_plain_decoding(shared, data, batch):
    model, tokenizer, target, plain_tokens = shared
    max_new = data.draw(st.integers(1, 40), "max_new_tokens")
    sampling = data.draw(
        st.sampled_from([{}, {"temperature": 0.8, "seed": 5}, {"temperature": 1.3, "top_k": 8, "seed": 9}]), "sampling"
    )
    policy = data.draw(
        st.sampled_from([{}, {"adaptive_k": True}, {"cost_aware_k": True}, {"draft_tree": 3}, {"draft_tree": "auto"}]),
        "draft policy",
    )
    engine = Engine(
        model,
        tokenizer,
        drafter=_drafter(data),
        target=target,
        max_num_seqs=data.draw(st.integers(1, 4), "max_num_seqs"),
    )
    results = engine.generate(
        batch, max_new_tokens=max_new, draft_k=data.draw(st.integers(1, 8), "K"), **policy, **sampling
    )
    for prompt, result in zip(batch, results):
        assert result.token_ids == plain_tokens(prompt, max_new, sampling)
        stats = result.acceptance
        assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    assert not engine.has_unfinished()
    pool = engine.block_pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref_count)  # every KV block given back


@ENGINE_FUZZ
@given(prompt=prompts, data=st.data())
def test_engine_accepts_exactly_the_prefix_an_oracle_drafted_right(shared, oracle_drafter, prompt, data):
    model, tokenizer, target, plain_tokens = shared
    max_new = data.draw(st.integers(2, 40), "max_new_tokens")
    reference = prompt + plain_tokens(prompt, max_new, {})
    rate = data.draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]), "corruption rate")
    seed = data.draw(st.integers(0, 2**16), "pattern seed")
    pattern = torch.rand(64, 16, generator=torch.Generator().manual_seed(seed)) < rate  # [step, draft position]
    drafter = oracle_drafter(reference, corrupt=lambda s, i: bool(pattern[s, i]))
    engine = Engine(model, tokenizer, drafter=drafter, target=target)
    stream = engine.stream(
        prompt,
        max_new_tokens=max_new,
        draft_k=data.draw(st.integers(1, 8), "K"),
        adaptive_k=data.draw(st.booleans(), "adaptive"),
        speculation_guard=False,  # (the pattern is indexed by step: every step drafts)
    )
    steps = list(stream)
    assert stream.result.token_ids == reference[len(prompt) :]
    for s, step in enumerate(steps[1:]):
        bad = [i for i in range(step.num_drafted) if pattern[s, i]]
        assert step.num_accepted == (bad[0] if bad else step.num_drafted)
        assert len(step.token_ids) == step.num_accepted + 1 or step is steps[-1]
    assert stream.result.acceptance.accepted_tokens == sum(s.num_accepted for s in steps)
