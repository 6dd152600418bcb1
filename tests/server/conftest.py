"""Servers for the server tests: uvicorn in a thread on 127.0.0.1, on a free port.

* ``tiny_server``: the tiny random-weight Llama (fast; protocol and error tests),
  with a character tokenizer given a one-line chat template;
* ``embedded_server``: the embedded SmolLM2-135M-Instruct with the n-gram
  drafter (integration tests: the openai client, load, the browser page).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn  # noqa: E402

from fastdecode.engine import Engine  # noqa: E402
from fastdecode.server.app import create_app  # noqa: E402

EMBEDDED_NAME = "smollm2-135m"


class ServerThread:
    """``app`` served by uvicorn on a thread; ``url`` is http://127.0.0.1:PORT."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


@contextlib.contextmanager
def serve(app):
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def serve_app():
    """``with serve_app(app) as server:`` runs ``app`` on a free loopback port."""
    return serve


def with_chat_template(tokenizer):
    """A copy of the tests' character tokenizer with a chat template: "role: content | ... | assistant: "."""

    class ChatCharTokenizer(type(tokenizer)):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            assert not tokenize
            text = " | ".join(f"{m['role']}: {m['content']}" for m in messages)
            return text + (" | assistant: " if add_generation_prompt else "")

    chat = ChatCharTokenizer(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    chat.chat_template = "role: content | ..."  # rendered by apply_chat_template above
    return chat


@pytest.fixture(scope="session")
def chat_tokenizer(tokenizer):
    return with_chat_template(tokenizer)


@pytest.fixture(scope="module")
def tiny_server(tiny_model, chat_tokenizer):
    """The tiny model behind a server named "tiny", 4 sequences at once, no drafter."""
    torch.set_num_threads(1)
    engine = Engine(tiny_model, chat_tokenizer, max_num_seqs=4)
    with serve(create_app(engine, model_name="tiny")) as server:
        server.engine = engine
        yield server


# -- the embedded model ------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_model(default_num_threads):
    from fastdecode.loading import load_model

    torch.set_num_threads(default_num_threads)
    return load_model(EMBEDDED_NAME)


REFERENCE_PROMPT = "Write one sentence about the sea."
REFERENCE_MAX_TOKENS = 24


@pytest.fixture(scope="session")
def _embedded_server(smollm2_model):
    from fastdecode.drafters.factory import DrafterOptions

    model, tokenizer = smollm2_model
    engine = Engine(model, tokenizer, drafter=DrafterOptions(name="ngram").build(), max_num_seqs=8, kv_cache_gb=0.25)
    # What `fastdecode generate --prompt REFERENCE_PROMPT --max-new-tokens 24` prints: the chat template,
    # greedy, plain decoding (cmd_generate is engine.stream over the same options).
    reference = engine.generate(REFERENCE_PROMPT, max_new_tokens=REFERENCE_MAX_TOKENS, temperature=0.0, speculate=False)
    with serve(create_app(engine, model_name=EMBEDDED_NAME)) as server:
        server.engine = engine
        server.reference = reference
        yield server


@pytest.fixture
def embedded_server(_embedded_server, default_num_threads):
    """The embedded model (n-gram drafter, 8 sequences at once) behind a server named "smollm2-135m"."""
    torch.set_num_threads(default_num_threads)
    return _embedded_server
