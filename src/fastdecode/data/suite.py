"""The built-in offline prompt suite (summarize, qa, code, translate, chat)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class PromptSample:
    prompt: str
    category: str


def builtin_suite() -> list[PromptSample]:
    text = resources.files("fastdecode").joinpath("data/suite.jsonl").read_text(encoding="utf-8")
    return [PromptSample(**json.loads(line)) for line in text.splitlines() if line.strip()]
