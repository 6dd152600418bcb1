"""fastdecode: lossless speculative decoding for Hugging Face causal LMs."""

from fastdecode.api import accelerate
from fastdecode.drafters import Draft, Drafter, available_drafters, build_drafter, register_drafter
from fastdecode.engine import Engine, GenerationConfig, Step
from fastdecode.errors import FastDecodeError
from fastdecode.loading import load_model
from fastdecode.metrics import AcceptanceStats, GenerationResult
from fastdecode.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = [
    "accelerate",
    "load_model",
    "Engine",
    "GenerationConfig",
    "GenerationResult",
    "AcceptanceStats",
    "SamplingParams",
    "Step",
    "Draft",
    "Drafter",
    "available_drafters",
    "build_drafter",
    "register_drafter",
    "FastDecodeError",
]
