"""``bench --background-load N``: N busy processes while the run measures, none after it."""

from __future__ import annotations

import time

import pytest

from fastdecode.bench.load import background_load, load_average


def test_the_background_load_runs_for_the_block_and_stops_after_it():
    with background_load(2) as procs:
        assert len(procs) == 2
        time.sleep(0.2)
        assert all(p.poll() is None for p in procs)  # busy, still running
    assert all(p.poll() is not None for p in procs)
    with background_load(0) as procs:
        assert procs == []


def test_the_background_load_ends_by_itself_at_its_deadline():
    with background_load(1, max_s=0.2) as procs:
        assert procs[0].wait(timeout=30) == 0


def test_bench_takes_the_option(bench_parser):
    args = bench_parser.parse_args(["bench", "--background-load", "2"])
    assert args.background_load == 2
    with pytest.raises(SystemExit):
        bench_parser.parse_args(["bench", "--background-load", "-1"])
    assert load_average() is None or len(load_average()) == 3


@pytest.fixture
def bench_parser():
    import argparse

    from fastdecode.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser
