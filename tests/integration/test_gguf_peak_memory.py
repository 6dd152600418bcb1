"""Loading a GGUF costs about its file size: peak resident memory of `fastdecode generate` on a
generated file of 0.57 GB, with the default options, is at most 1.15 x the file + its KV cache + 300 MB
(issue 41)."""

import json
import os
import sys
from pathlib import Path

import pytest

import fastdecode
from fastdecode.bench.scale import run_child
from fastdecode.bench.synthetic_gguf import VOCAB, write_synthetic_gguf
from fastdecode.formats.gguf_export import DecoderShape

# 32 layers of 1024 (16 query / 4 KV heads of 64, FFN 4096) and the embedded 49,152-token
# vocabulary: 0.54 B parameters, 0.57 GB in Q8_0, written in seconds.
SHAPE = DecoderShape("llama", 1024, 32, 16, 4, 64, 4096, VOCAB, 4096, 500000.0, 1e-5)
KV_CACHE_GB = 0.25  # --kv-cache-gb: the KV cache's bytes are this budget at most
SLACK_BYTES = 300 * 10**6


@pytest.mark.integration
def test_generate_peaks_near_the_file_size(tmp_path):
    path = write_synthetic_gguf(tmp_path / "mem-q8_0.gguf", SHAPE, "q8_0", label="memory test")
    file_bytes = path.stat().st_size
    assert file_bytes >= 0.5e9
    src = str(Path(fastdecode.__file__).parents[1])  # this checkout's package, in the child too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    env["FASTDECODE_NO_CACHE"] = "1"  # no converted copy written to the user's cache
    cmd = [sys.executable, "-m", "fastdecode.cli", "generate", "--model", str(path), "--prompt", "hi"]
    cmd += ["--max-new-tokens", "4", "--json", "--kv-cache-gb", str(KV_CACHE_GB)]  # the default --weights (auto)
    run = run_child(cmd, timeout_s=1800, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["weights"] == "gguf:q8_0"  # the file's own blocks, taken by default
    kv_bytes = int(KV_CACHE_GB * 2**30)
    budget = 1.15 * file_bytes + kv_bytes + SLACK_BYTES
    ratio = run.peak_rss_bytes / file_bytes
    print(f"peak RSS {run.peak_rss_bytes / 1e9:.2f} GB = {ratio:.2f} x the file ({file_bytes / 1e9:.2f} GB)")
    assert run.peak_rss_bytes <= budget, (
        f"peak RSS {run.peak_rss_bytes / 1e9:.2f} GB ({ratio:.2f} x the file) > 1.15 x {file_bytes / 1e9:.2f} GB "
        f"+ KV {kv_bytes / 1e9:.2f} GB + 0.3 GB = {budget / 1e9:.2f} GB"
    )
