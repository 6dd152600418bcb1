"""The decoder architectures the native path runs, each described once as data.

Every supported model is one decoder layer - attention with RoPE over a paged cache,
then an FFN, each branch with its norms and a residual add - and differs only in
what :class:`DecoderArch` names: where the norms are (before each branch, after it,
or both), whether queries and keys are normalised (per head or over the whole
projection), the activation, the multipliers (embeddings, attention, residual
branches, logits), the RoPE of each layer (or none: NoPE), sliding windows, and where
each part lies in a transformers layer (:class:`LayerParts`). ``backends/layer.py``
builds and runs a layer from this description on the torch path and ``kernels/cpu.c``'s
``fd_layer`` on the C path; neither asks which model it runs.

A new dense architecture is one :data:`ARCHITECTURES` entry - a function from its
transformers config to its :class:`DecoderArch`, refusing clearly what it does not
describe - plus its tests (``tests/backends/test_architectures.py``). The FFN is of a
kind (:attr:`DecoderArch.ffn`): a gated MLP, or ``"experts"`` (mixture of experts, its
routing an :class:`Experts`: Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss), one module each in
``backends/`` that every architecture with it shares.
"""

from fastdecode.architectures.description import (
    NOPE,
    DecoderArch,
    Experts,
    LayerParts,
    Unsupported,
    context_length_of,
    head_dim_of,
)
from fastdecode.architectures.registry import (
    ARCHITECTURES,
    HF_BACKEND_NOTE,
    NATIVE_MODEL_TYPES,
    Architecture,
    decoder_arch,
    layer_parts,
    native_support,
)
from fastdecode.architectures.table import (
    ArchitectureSupport,
    architectures_markdown,
    gguf_tensor_name,
    supported_architectures,
)

__all__ = [
    "ARCHITECTURES",
    "HF_BACKEND_NOTE",
    "NATIVE_MODEL_TYPES",
    "NOPE",
    "Architecture",
    "ArchitectureSupport",
    "DecoderArch",
    "Experts",
    "LayerParts",
    "Unsupported",
    "architectures_markdown",
    "context_length_of",
    "decoder_arch",
    "gguf_tensor_name",
    "head_dim_of",
    "layer_parts",
    "native_support",
    "supported_architectures",
]
