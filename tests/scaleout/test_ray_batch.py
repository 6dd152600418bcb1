"""``generate --prompts-file --out --ray``: the Ray Data batch job, resumable and exactly once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

from fastdecode.args import EngineArgs
from fastdecode.cli.commands import _PROMPT_LINE_OPTIONS
from fastdecode.scaleout.batch import generate_records, run_batch

NUM_PROMPTS = 200
# What a result says about its output (its timings differ run to run, and its drafting and
# cache figures with what the engine saw before: the n-gram drafter and the prefix cache
# remember earlier requests).
OUTPUT = ("index", "id", "token_ids", "text", "num_prompt_tokens", "num_new_tokens", "finish_reason", "drafter")


def prompts_items() -> list[dict]:
    items = [
        {"id": f"p{i}", "prompt": " ".join(f"w{(3 * i + j) % 61}" for j in range(5)), "max_new_tokens": 4 + i % 5}
        for i in range(NUM_PROMPTS)
    ]
    items[7]["temperature"], items[7]["seed"] = 0.8, 3  # a seeded sampled line: the same in every run
    return items


def output(record: dict) -> dict:
    return {k: record.get(k) for k in OUTPUT}


def map_worker_pids() -> list[int]:
    """The processes of Ray Data's actors (its map workers hold the engines)."""
    import ray  # (here, not at the top: the test asks for ray_cluster, which skips it without Ray)

    actors = ray._private.state.actors().values()
    return [a["Pid"] for a in actors if a["State"] == "ALIVE" and "MapWorker" in a["ActorClassName"] and a["Pid"]]


def test_a_worker_killed_mid_job_then_a_rerun_gives_each_id_once(ray_cluster, tiny_model_dir, tmp_path):
    items = prompts_items()
    engine_args = EngineArgs(model=tiny_model_dir, drafter="ngram")
    config = engine_args.generation_config(max_new_tokens=8)
    reference = generate_records(engine_args.create_engine(config), list(enumerate(items)), None, _PROMPT_LINE_OPTIONS)
    out = str(tmp_path / "out.jsonl")
    job = dict(workers=2, worker_cpus=0.5, batch_size=10, option_keys=_PROMPT_LINE_OPTIONS)

    errors = []

    def first_run():
        try:
            run_batch(items, out, engine_args, config, **job)
        except Exception as exc:  # a stopped job is allowed: the rerun finishes it
            errors.append(exc)

    thread = threading.Thread(target=first_run)
    thread.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and thread.is_alive() and time.monotonic() < deadline:
        if os.path.exists(out) and os.path.getsize(out) > 0 and (pids := map_worker_pids()):
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    thread.join(180)
    assert not thread.is_alive(), "the batch job hung"
    assert killed is not None, "the job ended before a worker could be killed"

    run_batch(items, out, engine_args, config, **job)  # the rerun: finishes whatever is missing
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["id"] for r in records] == [item["id"] for item in items]  # each id once, in input order
    assert [output(r) for r in records] == [output(r) for r in reference]
    assert run_batch(items, out, engine_args, config, **job) == 0  # a third run has nothing to do
