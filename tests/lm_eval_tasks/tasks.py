"""The data of the fastdecode_* lm-evaluation-harness tasks (YAML beside this file), read
from the JSON lines file here, so lm-eval needs no network and no dataset hub."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("fastdecode_mc.jsonl")


def load(**kwargs):
    """lm-eval's ``custom_dataset`` hook: the items as a DatasetDict with one "test" split."""
    import datasets

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
