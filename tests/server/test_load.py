"""A bounded load test on loopback: 32 concurrent openai clients, 2 requests each, on the
embedded model. Every request completes, none is lost or duplicated, and every greedy
output equals the same prompt run alone. The time limit only catches a hang."""

from __future__ import annotations

import asyncio

import pytest

# openai is imported by the test (an integration test: collecting this module, as the unit run
# does before deselecting it, imports none of it)


MODEL = "smollm2-135m"
CLIENTS = 32
REQUESTS_PER_CLIENT = 2
MAX_TOKENS = 8
HANG_LIMIT_S = 300
PROMPTS = [
    "Name a fruit.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Name a planet.",
    "What color is the sky?",
    "Give me a word that rhymes with cat.",
    "What is the capital of Italy?",
    "Name a musical instrument.",
]


async def ask(client, prompt: str, stream: bool, speculate: bool, user: str) -> tuple[str, str, int]:
    """(text, response id, completion tokens) of one greedy chat request."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        user=user,
        extra_body={"speculate": speculate},
    )
    if not stream:
        r = await client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.id, r.usage.completion_tokens
    text, ids, usage = "", set(), None
    async for chunk in await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        ids.add(chunk.id)
        for choice in chunk.choices:
            text += choice.delta.content or ""
        usage = chunk.usage or usage
    assert len(ids) == 1
    return text, ids.pop(), usage.completion_tokens


def test_concurrent_clients_all_complete_with_the_alone_output(embedded_server):
    openai = pytest.importorskip("openai")

    async def run():
        async with openai.AsyncOpenAI(
            base_url=embedded_server.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_LIMIT_S
        ) as client:
            # Each prompt alone first: one request at a time.
            alone = {p: (await ask(client, p, False, False, "alone"))[0] for p in PROMPTS}

            async def one_client(k: int):
                results = []
                for j in range(REQUESTS_PER_CLIENT):
                    prompt = PROMPTS[(k + j) % len(PROMPTS)]
                    results.append((k, j, prompt, *await ask(client, prompt, (k + j) % 2 == 0, k % 3 != 0, f"c{k}")))
                return results

            batches = await asyncio.wait_for(asyncio.gather(*(one_client(k) for k in range(CLIENTS))), HANG_LIMIT_S)
            return alone, [r for batch in batches for r in batch]

    alone, results = asyncio.run(run())
    assert sorted((k, j) for k, j, *_ in results) == [
        (k, j) for k in range(CLIENTS) for j in range(REQUESTS_PER_CLIENT)
    ]
    assert len({response_id for *_, response_id, _ in results}) == CLIENTS * REQUESTS_PER_CLIENT
    for k, j, prompt, text, _, completion_tokens in results:
        assert text == alone[prompt], (k, j, prompt)
        assert 1 <= completion_tokens <= MAX_TOKENS
