"""Row-invariant CPU kernels (``cpu.c``): a small-M GEMM over float32 or int8
weights, causal attention by query row, and the fused glue of a decoder layer.
Load, call.

Why a hand-written kernel: a verification pass must give each of its K+1 rows
the very bits a one-token decode step gives that row (the output is then equal
to plain decoding by construction), and it must cost little more than one
step (otherwise speculation does not pay). torch's float32 ``F.linear`` runs
MKL, which gives a row the same bits only within row-count groups (the native
decoder then pads decode steps to two rows and cuts verification into chunks
of three, each costing about a decode step); oneDNN's prepacked linear is
invariant but slower at one row (docs/benchmarks.md). ``cpu.c`` reduces
every output in one fixed order whatever the row count, streaming the weights
once per call. Attention likewise: torch's SDPA gives a query row other bits
in an 8-query call than alone, so the native decoder called it once per row
and layer; ``attention_rows`` computes every (row, head) alone in one call.

How it is built and loaded: ``fastdecode.kernels.build`` (on first use, with the
machine's C compiler, into the fastdecode cache); :func:`rowgemm_unavailable` says
why it cannot be had here (not x86-64, no AVX2/FMA, no compiler) and callers fall
back to ``F.linear``. The ctypes signatures and structures: ``fastdecode.kernels.abi``.

This module loads the library (and installs its loader in ``fastdecode.kernels.library``)
and re-exports the wrappers: the kernels one call at a time in ``fastdecode.kernels.ops``,
the fused decoder layer and the projections in ``fastdecode.kernels.layer``.
"""

from __future__ import annotations

import ctypes
import functools

from fastdecode.kernels import library
from fastdecode.kernels.abi import GLU_ACTIVATIONS, MAX_HEAD_DIM, CLayerDesc, bind
from fastdecode.kernels.build import SOURCE, SOURCES, build, cpu_reason, find_compiler
from fastdecode.kernels.layer import DecoderLayerKernel, LayerStack, Projection, run_layer_stack
from fastdecode.kernels.ops import (
    attention_rows,
    clamped_glu,
    glu,
    head_rms_norm_,
    kv_mirror,
    qk_rms_norm_,
    rms_norm,
    rope_qkv,
    rowgemm,
    rowgemm_i8,
)
from fastdecode.kernels.paged import PagedRows

__all__ = [
    "GLU_ACTIVATIONS",
    "MAX_HEAD_DIM",
    "SOURCE",
    "SOURCES",
    "CLayerDesc",
    "DecoderLayerKernel",
    "LayerStack",
    "PagedRows",
    "Projection",
    "attention_rows",
    "clamped_glu",
    "glu",
    "head_rms_norm_",
    "kv_mirror",
    "qk_rms_norm_",
    "rms_norm",
    "rope_qkv",
    "rowgemm",
    "rowgemm_i8",
    "rowgemm_unavailable",
    "run_layer_stack",
]


def _compiler() -> str | None:
    return find_compiler()


@functools.lru_cache(maxsize=1)
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library with its functions typed, None) or (None, why it cannot be had)."""
    reason = cpu_reason()
    if reason is not None:
        return None, reason
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found to build the row-invariant kernel (set CC, or install gcc)"
    try:
        return bind(ctypes.CDLL(str(build(cc, SOURCE)))), None
    except (OSError, RuntimeError) as exc:
        return None, f"the row-invariant kernel could not be built: {exc}"


def rowgemm_unavailable() -> str | None:
    """None when :func:`rowgemm` can run on this machine, else why not."""
    return _load()[1]


def _kernel() -> ctypes.CDLL:
    kernel, reason = _load()
    if kernel is None:
        raise RuntimeError(reason)
    return kernel


library.install(lambda: _kernel())  # looked up on each call, as _load in it: a test may replace or reset them
