"""Pruning's entries: the compression methods ``magnitude``, ``wanda`` and ``sparsegpt``
(``fastdecode.quant.pruning``), and the ``sparse24`` weight format their 2:4 output runs in.

``compress --method wanda --pattern 2:4 [--then q8_0] --out DIR`` prunes (and quantizes);
``--weights sparse24`` runs 2:4-sparse weights on the native decoder in a layout that stores
only the kept half (:mod:`fastdecode.kernels.sparse`).
"""

from __future__ import annotations

import dataclasses

from fastdecode.errors import ConfigError
from fastdecode.formats.base import COMPRESSION_METHODS, WEIGHT_FORMATS, CompressionMethod
from fastdecode.quant.pruning import PRUNING_METHODS, PruneConfig

_PRUNE_FIELDS = {f.name for f in dataclasses.fields(PruneConfig)} - {"method", "then"}


def then_names() -> tuple[str, ...]:
    """What ``--then`` takes: the formats a model is saved in, then the other compression methods."""
    formats = (f.name for f in WEIGHT_FORMATS if f.listed and f.quant_config is not None and f.saved is not None)
    methods = (m.name for m in COMPRESSION_METHODS if m.name not in PRUNING_METHODS)
    return (*formats, *methods)


def _then_config(name: str, group_size: int | None, settings: dict):
    if name not in then_names():
        raise ConfigError(f"--then takes one of {', '.join(then_names())}, not {name!r}")
    entry = COMPRESSION_METHODS.get(name) if name in COMPRESSION_METHODS else WEIGHT_FORMATS.get(name)
    return entry.quant_config(group_size, **settings)


def _pruning_config(method: str):
    def quant_config(group_size: int | None = None, then: str | None = None, **settings) -> PruneConfig:
        """``config_from_method(method, sparsity=... | pattern="2:4", then="q8_0", ...)``: the
        settings PruneConfig does not take (and the group size) go to ``then``'s config."""
        own = {k: v for k, v in settings.items() if k in _PRUNE_FIELDS}
        rest = {k: v for k, v in settings.items() if k not in _PRUNE_FIELDS}
        if then is None and (rest or group_size is not None):
            raise ConfigError(
                f"{method} without --then keeps float weights: it takes no {sorted(rest) or 'group size'}"
            )
        then_config = None if then is None else _then_config(then, group_size, rest)
        return PruneConfig(method=method, then=then_config, **own)

    return quant_config


_SHAPE = "to --sparsity S (unstructured, default 0.5) or --pattern N:M (2:4, 4:8); --then FORMAT to quantize after"
MAGNITUDE = CompressionMethod(
    name="magnitude",
    help=f"magnitude pruning (|W|, per layer) {_SHAPE}",
    quant_config=_pruning_config("magnitude"),
    formats=("float",),
    drafts=False,
)
WANDA = CompressionMethod(
    name="wanda",
    help=f"Wanda pruning (|W| x ||X||2 per input channel, per output row; calibrated) {_SHAPE}",
    quant_config=_pruning_config("wanda"),
    formats=("float",),
    drafts=False,
)
SPARSEGPT = CompressionMethod(
    name="sparsegpt",
    help=f"SparseGPT pruning (OBS reconstruction from the calibration Hessian) {_SHAPE}; "
    "with --then q8_0|q4_0 it rounds jointly",
    quant_config=_pruning_config("sparsegpt"),
    formats=("float", "q8_0", "q4_0"),
    drafts=False,
)
PRUNING = (MAGNITUDE, WANDA, SPARSEGPT)
