"""lm-evaluation-harness as a real client, offline: its ``local-completions`` model (prompt
log-probabilities through ``echo`` + ``logprobs``) against ``fastdecode serve`` scores the
repository's multiple-choice task (tests/lm_eval_tasks) exactly as lm-eval's own ``hf``
model does on the same weights (float32, the same tokenizer): every choice's log-likelihood
to 1e-4, the same accuracy (the server computing a question's prompt rows once for all its
choices: ``Scheduler._shared_prefix``). And ``local-chat-completions`` runs a ``generate_until`` task
through the chat endpoint, greedy, with the n-gram drafter on: the same completions as
``hf`` with the same chat template.

The model: a tiny random-weight Llama with the embedded model's tokenizer (49,152 tokens,
its chat template), saved to a directory that both load; nothing touches the network."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

TASKS = Path(__file__).resolve().parents[1] / "lm_eval_tasks"
NAME = "tiny-lm"
GEN_DOCS = 12  # greedy decoding is the slow part; the log-likelihood test scores all 36
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    from tiny_models import tiny_llama

    tok = smollm2_tokenizer
    model = tiny_llama(
        7,
        vocab_size=len(tok),
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-lm")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server_url(model_dir, tmp_path_factory):
    """``fastdecode serve`` on the tiny model, with the n-gram drafter, started and awaited as
    ``fastdecode bench-serve`` starts its servers."""
    from fastdecode.bench.serve_servers import FASTDECODE, SERVERS, ServerProcess, free_port

    port = free_port()
    command = [sys.executable, "-m", "fastdecode.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", NAME, "--drafter", "ngram", "--max-num-seqs", "32", "--log-level", "warning"]
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with pytest.MonkeyPatch.context() as mp:  # the server's environment: offline, this checkout's sources
        for key, value in {**OFFLINE, "PYTHONPATH": os.pathsep.join(sys.path)}.items():
            mp.setenv(key, value)
        server = ServerProcess(SERVERS.get(FASTDECODE), command, port, log_path)
    try:
        server.wait_ready(timeout_s=120, deadline=math.inf)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def evaluate(monkeypatch_module):
    """``evaluate(model, model_args, task, **kw)``: lm-eval's simple_evaluate on one of the
    repository's tasks; its samples, in document order."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for key, value in OFFLINE.items():
        monkeypatch_module.setenv(key, value)
    manager = TaskManager(include_path=str(TASKS))

    def run(model: str, model_args: dict, task: str, **kwargs) -> tuple[dict, list[dict]]:
        out = simple_evaluate(
            model=model, model_args=model_args, tasks=[task], task_manager=manager, log_samples=True, **kwargs
        )
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        return out["results"][task], samples

    return run


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def hf_args(model_dir) -> dict:
    return {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}


def test_loglikelihood_through_the_server_equals_lm_evals_hf_model(server_url, model_dir, evaluate):
    served_args = {
        "model": NAME,
        "base_url": server_url + "/v1/completions",
        "tokenizer": str(model_dir),
        "tokenizer_backend": "huggingface",
        "max_length": 512,
        "num_concurrent": 4,  # 4 requests of 8 prompts in one pass: a question's choices share its rows
    }
    served, served_samples = evaluate("local-completions", served_args, "fastdecode_mc", batch_size=8)
    hf, hf_samples = evaluate("hf", hf_args(model_dir), "fastdecode_mc", batch_size=8)
    assert len(served_samples) == len(hf_samples) == 36
    worst = 0.0
    for a, b in zip(served_samples, hf_samples):
        assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
        lls_a = [float(r[0]) for r in a["filtered_resps"]]
        lls_b = [float(r[0]) for r in b["filtered_resps"]]
        assert all(math.isfinite(x) and x < 0 for x in lls_a)
        worst = max(worst, *(abs(x - y) for x, y in zip(lls_a, lls_b)))
        assert a["acc"] == b["acc"] and a["acc_norm"] == b["acc_norm"]
    assert worst <= 1e-4, worst
    assert served["acc,none"] == hf["acc,none"] and served["acc_norm,none"] == hf["acc_norm,none"]


def test_generate_until_through_the_chat_endpoint_equals_lm_evals_hf_model(server_url, model_dir, evaluate):
    served_args = {"model": NAME, "base_url": server_url + "/v1/chat/completions", "num_concurrent": 4}
    kwargs = {"apply_chat_template": True, "limit": GEN_DOCS}
    served, served_samples = evaluate("local-chat-completions", served_args, "fastdecode_gen", **kwargs)
    hf, hf_samples = evaluate("hf", hf_args(model_dir), "fastdecode_gen", batch_size=8, **kwargs)
    assert len(served_samples) == len(hf_samples) == GEN_DOCS
    texts = [s["filtered_resps"][0] for s in served_samples]
    assert texts == [s["filtered_resps"][0] for s in hf_samples]
    assert any(texts)  # the model said something
    assert served["exact_match,none"] == hf["exact_match,none"]
