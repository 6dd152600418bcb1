"""One Ray instance for the scale-out tests (``ray.init(num_cpus=2)``, loopback only) and a tiny
random-weight model saved where its replicas and workers (other processes) can load it."""

from __future__ import annotations

import socket

import pytest

# The word tokenizer's words are w0 .. w60; the template joins the messages' contents.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="package")
def ray_cluster():
    """A local Ray instance with 2 CPUs (all the machine has), its object store kept small."""
    ray = pytest.importorskip("ray", reason="the scale-out tests need Ray: pip install 'fastdecode[ray]'")
    ray.init(
        num_cpus=2,
        num_gpus=0,
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama (bos 1, eos 2, words w0..w60) with a chat template, as a model directory."""
    from tiny_models import save_tiny_llama, word_tokenizer

    tokenizer = word_tokenizer(size=61)
    tokenizer.chat_template = CHAT_TEMPLATE
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer=tokenizer))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="package")
def port_factory():
    return free_port
