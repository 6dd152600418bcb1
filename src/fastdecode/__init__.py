"""fastdecode: lossless speculative decoding for Hugging Face causal LMs.

The public names are imported on first use (PEP 562): ``import fastdecode`` and the
``fastdecode`` command's argument parsing do not pay torch's ~1-2 s import, and a
Ctrl-C in that time ends the command with its one-line message, not a traceback."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "accelerate": "fastdecode.api",
    "EngineArgs": "fastdecode.args",
    "load_model": "fastdecode.loading",
    "Engine": "fastdecode.engine",
    "GenerationConfig": "fastdecode.engine",
    "Step": "fastdecode.engine",
    "GenerationResult": "fastdecode.decoding.metrics",
    "AcceptanceStats": "fastdecode.decoding.metrics",
    "SamplingParams": "fastdecode.decoding.sampling",
    "ProcessingParams": "fastdecode.decoding.logits_process",
    "GrammarSpec": "fastdecode.decoding.structured",
    "Draft": "fastdecode.drafters",
    "Drafter": "fastdecode.drafters",
    "available_drafters": "fastdecode.drafters",
    "build_drafter": "fastdecode.drafters",
    "register_drafter": "fastdecode.drafters",
    "FastDecodeError": "fastdecode.errors",
}
__all__ = [
    "accelerate",
    "EngineArgs",
    "load_model",
    "Engine",
    "GenerationConfig",
    "Step",
    "GenerationResult",
    "AcceptanceStats",
    "SamplingParams",
    "ProcessingParams",
    "GrammarSpec",
    "Draft",
    "Drafter",
    "available_drafters",
    "build_drafter",
    "register_drafter",
    "FastDecodeError",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs: the names as they are
    from fastdecode.api import accelerate
    from fastdecode.args import EngineArgs
    from fastdecode.decoding.logits_process import ProcessingParams
    from fastdecode.decoding.metrics import AcceptanceStats, GenerationResult
    from fastdecode.decoding.sampling import SamplingParams
    from fastdecode.decoding.structured import GrammarSpec
    from fastdecode.drafters import Draft, Drafter, available_drafters, build_drafter, register_drafter
    from fastdecode.engine import Engine, GenerationConfig, Step
    from fastdecode.errors import FastDecodeError
    from fastdecode.loading import load_model
