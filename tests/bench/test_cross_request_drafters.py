"""A drafter that learns across requests (suffix, recycling) never drafts a measured run from
the warm-up's output or from an earlier repeat of the same prompt."""

from __future__ import annotations

from fastdecode.bench.config import BenchConfig, ModelCache, build_engine
from fastdecode.bench.datasets import BenchSample
from fastdecode.bench.peers import EngineRunner
from fastdecode.bench.run import run_bench

PROMPTS = ["the cat sat on the mat and the cat sat", "one two three one two three one two"]


def _suffix_config(model_dir) -> BenchConfig:
    return BenchConfig(
        name="suffix",
        model=str(model_dir),
        drafter="suffix",
        drafter_options={"k": 4},
        generation_options={"max_new_tokens": 12},
        chat=False,
    )


def test_runner_snapshot_and_restore_forget_later_requests(tiny_model_dir):
    runner = EngineRunner(build_engine(_suffix_config(tiny_model_dir), ModelCache()), False)
    saved = runner.snapshot()
    runner.generate(PROMPTS[0], seed=0)
    assert len(runner.engine.drafter.history) == 1
    runner.restore(saved)
    assert len(runner.engine.drafter.history) == 0


def test_repeats_and_warmup_leave_one_document_per_sample(tiny_model_dir, monkeypatch):
    built = []
    import fastdecode.bench.run as run_module

    real = run_module.build_runner

    def keep(cfg, cache):
        built.append(real(cfg, cache))
        return built[-1]

    monkeypatch.setattr(run_module, "build_runner", keep)
    samples = [BenchSample(f"p/{i}", p, "p", "p") for i, p in enumerate(PROMPTS)]
    run = run_bench([_suffix_config(tiny_model_dir)], samples, ModelCache(), repeats=3, warmup=1, progress=False)
    assert len(run.rows) == len(PROMPTS)
    # the warm-up and the first two repeats of each sample were forgotten: one remembered output a sample
    assert len(built[0].engine.drafter.history) == len(PROMPTS)
