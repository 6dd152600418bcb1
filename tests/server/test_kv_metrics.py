"""``/metrics`` reports the KV cache's bytes as stored: allocated, and held by running requests."""

import re

import pytest
from tiny_models import tiny_llama

from fastdecode import Engine
from fastdecode.backends import make_target

pytest.importorskip("prometheus_client")

from fastdecode.server.metrics import ServerMetrics  # noqa: E402


def _sample(text: str, name: str) -> float:
    return float(re.search(rf'^fastdecode:{name}{{model_name="m"}} (\S+)$', text, re.M).group(1))


@pytest.mark.parametrize("kv,row_bytes", [("float32", 128), ("q8_0", 34), ("q4_0", 18)])
def test_kv_cache_bytes_in_use(tokenizer, kv, row_bytes):
    model = tiny_llama(0, vocab_size=96, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    engine = Engine(model, tokenizer, target=make_target(model, "native", kv_cache_dtype=kv), num_kv_blocks=10)
    metrics = ServerMetrics("m")
    metrics.observe_engine(engine)
    assert _sample(metrics.render().decode(), "kv_cache_bytes") == 0  # allocated on the first request
    engine.add_request([1] + [20] * 20, max_new_tokens=5)  # 21 prompt tokens: two blocks of 16
    engine.step()
    metrics.observe_engine(engine)
    text = metrics.render().decode()
    block_bytes = 2 * 2 * 16 * row_bytes  # K and V, 2 layers, 16 positions of one KV head's row
    assert _sample(text, "kv_cache_bytes") == 10 * block_bytes
    assert _sample(text, "kv_cache_used_bytes") == 2 * block_bytes
