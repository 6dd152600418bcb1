"""The lossless check every weight format's tests run (not a test module)."""

from fastdecode import Engine, build_drafter
from fastdecode.backends import make_target

PROMPT = [1, 40, 71, 9, 55, 23, 88, 14, 40, 71, 9, 55, 23, 88, 14, 40]


NEW_TOKENS = 40


def plain_generation(model, tokenizer, weights: str):
    """Plain decoding of :data:`PROMPT` on the native backend at ``weights``."""
    return Engine(model, tokenizer, target=make_target(model, "native", weights)).generate(
        PROMPT, max_new_tokens=NEW_TOKENS
    )


def assert_speculation_is_lossless(model, tokenizer, weights: str, plain, drafter: str) -> None:
    """Greedy speculation at ``weights`` gives ``plain``'s tokens: with an n-gram drafter (some drafts
    accepted), or with the model drafting for itself at the same weights ("self": every draft accepted)."""
    if drafter == "ngram":
        draft = build_drafter("ngram", n=3)
    else:
        draft = build_drafter("draft-model", model=model, k=3, weights=weights)
    engine = Engine(model, tokenizer, drafter=draft, target=make_target(model, "native", weights))
    result = engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, draft_k=3)
    assert result.token_ids == plain.token_ids
    acceptance = result.acceptance
    assert acceptance.drafted_tokens > 0
    if drafter == "self":
        assert acceptance.accepted_tokens == acceptance.drafted_tokens
    else:
        assert acceptance.accepted_tokens > 0
