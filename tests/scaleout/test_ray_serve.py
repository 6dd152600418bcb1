"""``fastdecode serve --replicas``: the Ray Serve application, on one local Ray instance.

Three applications share one Serve instance (each 2 engine replicas of a tiny random-weight
Llama with the n-gram drafter), one per routing: "pow2" (Ray Serve's default router, which
picks by queue length, so where a request lands depends on timing), "roundrobin" (its
RoundRobinRouter: each request to the next replica, so where a sequence of requests lands is
known) and "prefix" (its PrefixCacheAffinityRouter). Every request goes to 127.0.0.1; each test
sends a bounded number of requests, each with a timeout.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import httpx
import pytest

from fastdecode.args import EngineArgs

# Ray (Serve) is imported by the tests that use it, which all ask for ray_cluster (it skips them
# without Ray): collecting this module, as the unit run does before deselecting it, imports none.

MODEL = "tiny"
TIMEOUT_S = 60.0
REPLACE_TIMEOUT_S = 180.0  # a new replica imports torch and loads its model: slow on a loaded 2-core CI machine
ROUTINGS = ("pow2", "roundrobin", "prefix")
SYSTEM_PROMPTS = [" ".join(f"w{(7 * g + 3 * i) % 61}" for i in range(40)) for g in range(4)]


def engine_args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, drafter="ngram", max_num_seqs=4)


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_model_dir, port_factory):
    serve = pytest.importorskip("ray.serve")
    from fastdecode.scaleout.serve import ReplicaOptions, build_application

    port = port_factory()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = {"model_name": MODEL, "default_max_tokens": 8}
    for routing in ROUTINGS:
        replicas = ReplicaOptions(num_replicas=2, num_cpus=0.25, routing=routing, max_ongoing_requests=8)
        serve.run(
            build_application(engine_args(tiny_model_dir), options, replicas), name=routing, route_prefix=f"/{routing}"
        )
    try:
        yield {routing: f"http://127.0.0.1:{port}/{routing}" for routing in ROUTINGS}
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """Plain decoding (no drafter, greedy) in this process: what `fastdecode generate` prints."""
    engine = EngineArgs(model=tiny_model_dir).create_engine()

    def generate(prompt: str, max_tokens: int) -> str:
        return engine.generate(prompt, max_new_tokens=max_tokens, temperature=0.0, speculate=False).text

    return generate


def chat(url: str, messages: list[dict], max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def replicas_info(app: str) -> list[dict]:
    from ray import serve

    from fastdecode.scaleout.serve import ENGINE_DEPLOYMENT

    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app).broadcast("info").results(timeout_s=30)


def prompts(n: int) -> list[str]:
    return [" ".join(f"w{(5 * i + j) % 61}" for j in range(6)) for i in range(n)]


def test_two_replicas_answer_as_plain_decoding(apps, plain):
    url = apps["roundrobin"]  # 12 requests in turn: both replicas take some
    texts = prompts(12)
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda p: chat(url, [{"role": "user", "content": p}], 8), texts))
    served_by = set()
    for prompt, r in zip(texts, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == plain(prompt, 8)
        assert body["fastdecode"]["replica"] == r.headers["x-fastdecode-replica"]
        served_by.add(body["fastdecode"]["replica"])
    replicas = {i["replica"] for i in replicas_info("roundrobin")}
    assert served_by == replicas and len(replicas) == 2
    health = httpx.get(f"{url}/health", timeout=TIMEOUT_S).json()
    assert health["status"] == "ok" and set(health["replicas"]) == replicas
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
    for replica in replicas:
        assert f'fastdecode:request_success_total{{replica="{replica}"' in metrics


def test_a_replica_killed_mid_load(apps, plain):
    import ray

    url = apps["pow2"]
    before = replicas_info("pow2")
    victim = before[0]
    texts = prompts(16)

    def send(prompt: str):
        try:
            return chat(url, [{"role": "user", "content": prompt}], 100)
        except httpx.TimeoutException as exc:  # a hang: fails below
            return exc

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, p) for p in texts]
        next(as_completed(futures))  # the load is running: kill a replica while the rest are in flight
        in_flight = sum(not f.done() for f in futures)
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        responses = [f.result() for f in futures]
    assert in_flight > 0
    for prompt, r in zip(texts, responses):
        assert isinstance(r, httpx.Response), f"request hung: {r!r}"
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"] == plain(prompt, 100)
        else:
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "replica_unavailable" and error["message"]
    deadline = time.monotonic() + REPLACE_TIMEOUT_S
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=TIMEOUT_S).json()
        if len(health["replicas"]) == 2 and victim["replica"] not in health["replicas"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the killed replica was not replaced: {health}")
    r = chat(url, [{"role": "user", "content": texts[0]}], 8)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain(texts[0], 8)


def shared_prefix_run(url: str, rounds: int) -> tuple[dict[int, set[str]], int]:
    """Requests on 4 system prompts, one at a time, round r sending them in the order r, r+1, ...
    (mod 4), so that a router blind to prompts that takes 2 replicas in turn sends each prompt
    to the other replica every round (in the order 0, 1, 2, 3 each round, it would keep each
    prompt on one replica by chance): the replicas each prompt went to, and the prompt tokens
    the prefix caches answered."""
    served_by: dict[int, set[str]] = {g: set() for g in range(len(SYSTEM_PROMPTS))}
    cached = 0
    for r in range(rounds):
        for i in range(len(SYSTEM_PROMPTS)):
            g = (r + i) % len(SYSTEM_PROMPTS)
            messages = [{"role": "system", "content": SYSTEM_PROMPTS[g]}, {"role": "user", "content": f"w{r} w{g}"}]
            response = chat(url, messages, 2)
            assert response.status_code == 200, response.text
            body = response.json()
            served_by[g].add(body["fastdecode"]["replica"])
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return served_by, cached


def test_prefix_affinity_keeps_a_prefix_on_one_replica(apps):
    for body in (b"not json", b'{"messages": 5}', b'{"prompt": "w1", "model": "tiny"}'):  # routed all the same
        r = httpx.post(
            f"{apps['prefix']}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=TIMEOUT_S,
        )
        assert r.status_code == 400 and r.json()["error"]["message"]
    affinity, affinity_cached = shared_prefix_run(apps["prefix"], rounds=6)
    assert all(len(replicas) == 1 for replicas in affinity.values()), affinity
    assert len(set().union(*affinity.values())) == 2  # and the prefixes are spread over both
    # The negative control, the same requests in the same order: round robin splits every
    # prefix over both replicas, so their caches hold it twice and answer less of it.
    control, control_cached = shared_prefix_run(apps["roundrobin"], rounds=6)
    assert all(len(replicas) == 2 for replicas in control.values()), control
    assert affinity_cached > control_cached > 0
