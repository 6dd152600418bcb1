"""Weight formats: one registry entry per format (stub; the registry replaces these lists).

The names a front end offers come from here, never from lists of its own.
"""

from __future__ import annotations


def weight_format_names() -> tuple[str, ...]:
    """``--weights`` choices: the numeric models a target runs."""
    return ("float", "int8", "int4", "q8_0", "q4_0", "q4_1", "gguf")


def compress_method_names() -> tuple[str, ...]:
    """``fastdecode quantize --method`` choices: formats a model can be saved in."""
    return ("int8", "int4", "int4-gptq", "q8_0", "q4_0", "q4_1")


def draft_quant_names() -> tuple[str, ...]:
    """``--draft-quant`` choices: how a draft model's weights are held ("none": as loaded)."""
    return ("none", "int8", "int4", "int4-gptq", "q8_0", "q4_0", "q4_1", "gguf")
