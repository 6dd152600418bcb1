"""``fastdecode generate --prompts-file IN.jsonl --out OUT.jsonl --ray``: a batch job on Ray Data.

The prompts go through ``Dataset.map_batches`` over a pool of ``workers`` actors (``ActorPoolStrategy``),
each holding one engine built from the command's :class:`~fastdecode.args.EngineArgs`, which
decodes its batch of prompts together by continuous batching. Each result is one JSON line
keyed by its input: ``"id"`` where the input line has one, else its ``"index"`` (its position
among the prompts; keep the file as it is between runs).

Exactly once, however the job ends:

* only this process (the driver) writes OUT: it appends each batch's lines as Ray Data hands
  them over and flushes them to disk (``fsync``) before asking for more, skipping an id it
  already holds;
* a worker that dies mid-job loses only the batch it held; Ray Data restarts the actor and
  runs that batch again (its results reach the driver once, from the attempt that finished);
* a job that stops anyway (the driver killed, Ray Data out of retries) leaves OUT holding whole
  lines for finished ids, and at most one torn last line: a rerun drops that line, skips every
  id in OUT and runs the rest;
* once every id is in OUT, it is rewritten in input order (a temporary file renamed over it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from fastdecode.args import EngineArgs
from fastdecode.errors import ConfigError, FastDecodeError
from fastdecode.scaleout.ray_util import import_ray


def key_of(obj: dict, index: int) -> str:
    """The key of an input line (or of its result line): its id, else its position."""
    return f"id:{json.dumps(obj['id'], sort_keys=True)}" if "id" in obj else f"index:{index}"


def read_done(path: str) -> dict[str, str]:
    """The result lines already in ``path``, by key. A torn last line (a run stopped mid-write)
    is cut off the file, so that its id runs again."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        data = f.read()
    done: dict[str, str] = {}
    good = 0
    for raw in data.splitlines(keepends=True):
        try:
            record = json.loads(raw)
            complete = raw.endswith(b"\n") and isinstance(record, dict) and isinstance(record.get("index"), int)
        except ValueError:
            complete = False
        if not complete:
            if good + len(raw) < len(data):
                raise ConfigError(f"{path}: a line that is not a result ({raw[:80]!r}): is it another file?")
            with open(path, "r+b") as f:
                f.truncate(good)
            break
        done[key_of(record, record["index"])] = raw.decode("utf-8").rstrip("\n")
        good += len(raw)
    return done


def generate_records(engine, items: Sequence[tuple[int, dict]], chat: bool | None, option_keys: Sequence[str]):
    """One result record per ``(index, item)``, in that order, decoded together on ``engine``."""
    from fastdecode.engine import GenerationConfig

    ids = []
    for _, item in items:
        options = {k: v for k, v in item.items() if k in option_keys}
        if isinstance(options.get("stop"), list):
            options["stop"] = tuple(options["stop"])
        ids.append(
            engine.add_request(item["prompt"], GenerationConfig.from_options(engine.config, **options), chat=chat)
        )
    results: dict[str, Any] = {}
    pending = set(ids)
    while pending:
        for out in engine.step():
            if out.finished and out.request_id in pending:
                results[out.request_id] = out.result
                pending.discard(out.request_id)
    records = []
    for (index, item), request_id in zip(items, ids):
        records.append(
            {"index": index, **({"id": item["id"]} if "id" in item else {}), **results[request_id].to_dict()}
        )
    return records


class GenerateWorker:
    """A Ray Data actor: one engine, called on batches of ``{"index", "line"}`` rows."""

    def __init__(self, engine_args: EngineArgs, config, chat: bool | None, option_keys: Sequence[str]) -> None:
        self.engine = engine_args.create_engine(config)
        self.chat = chat
        self.option_keys = tuple(option_keys)

    def __call__(self, batch: dict) -> dict[str, list]:
        items = [(int(i), json.loads(line)) for i, line in zip(batch["index"], batch["line"])]
        records = generate_records(self.engine, items, self.chat, self.option_keys)
        return {"key": [key_of(r, r["index"]) for r in records], "record": [json.dumps(r) for r in records]}


def check_items(items: Sequence[dict], source: str) -> list[str]:
    """The keys of the input lines; one ConfigError for an id given twice."""
    keys, seen = [], {}
    for index, item in enumerate(items):
        key = key_of(item, index)
        if key in seen:
            raise ConfigError(f"{source}: lines {seen[key] + 1} and {index + 1} have the same id {item['id']!r}")
        seen[key] = index
        keys.append(key)
    return keys


def _append(ds, out_path: str, done: dict[str, str]) -> None:
    with open(out_path, "a", encoding="utf-8") as f:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for key, record in zip(batch["key"], batch["record"]):
                if str(key) not in done:
                    f.write(f"{record}\n")
                    done[str(key)] = str(record)
            f.flush()
            os.fsync(f.fileno())


def _rewrite_in_order(out_path: str, keys: Sequence[str], done: dict[str, str]) -> None:
    tmp = f"{out_path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(f"{done[k]}\n" for k in keys)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_path)


def run_batch(
    items: Sequence[dict],
    out_path: str,
    engine_args: EngineArgs,
    config,
    *,
    workers: int = 2,
    worker_cpus: float = 1.0,
    batch_size: int = 16,
    chat: bool | None = None,
    option_keys: Sequence[str] = (),
    source: str = "prompts file",
    ray_address: str | None = None,
) -> int:
    """Run ``items`` (checked prompts-file lines) not yet in ``out_path``; the number run now."""
    ray = import_ray("generate --ray")
    engine_args.validate()
    keys = check_items(items, source)
    done = read_done(out_path)
    todo = [(i, item) for i, (key, item) in enumerate(zip(keys, items)) if key not in done]
    if todo:
        started = not ray.is_initialized()
        if started:
            ray.init(address=ray_address, include_dashboard=False)
        try:
            rows = [{"index": i, "line": json.dumps(item)} for i, item in todo]
            ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // batch_size))).map_batches(
                GenerateWorker,
                fn_constructor_kwargs=dict(engine_args=engine_args, config=config, chat=chat, option_keys=option_keys),
                batch_size=batch_size,
                compute=ray.data.ActorPoolStrategy(size=workers),
                num_cpus=worker_cpus,
            )
            _append(ds, out_path, done)
        except FastDecodeError:
            raise
        except Exception as exc:  # Ray's errors: what finished is in OUT
            raise ConfigError(
                f"the batch job stopped ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"{sum(k in done for k in keys)} of {len(keys)} results are in {out_path}: run the same command again "
                "to finish the rest"
            ) from None
        finally:
            if started:
                ray.shutdown()
    missing = [k for k in keys if k not in done]
    if missing:
        raise ConfigError(f"{len(missing)} results are missing from {out_path}: run the same command again")
    _rewrite_in_order(out_path, keys, done)
    return len(todo)
