"""``fastdecode bench``: measure drafters and settings on a model and machine.

Data flows one way: datasets -> a matrix of :class:`BenchConfig` (matrix,
sweeps, peers) -> ``run_bench`` (one row per config per sample) -> pure
aggregation (aggregate) -> report.md, results.jsonl, summary.json and plots.
"""

from fastdecode.bench.config import BenchConfig, ModelCache, build_engine
from fastdecode.bench.datasets import BenchSample, DatasetOptions, load_samples
from fastdecode.bench.matrix import MatrixSpec, build_matrix
from fastdecode.bench.run import BenchRun, run_bench

__all__ = [
    "BenchConfig",
    "ModelCache",
    "build_engine",
    "BenchSample",
    "DatasetOptions",
    "load_samples",
    "MatrixSpec",
    "build_matrix",
    "BenchRun",
    "run_bench",
]
