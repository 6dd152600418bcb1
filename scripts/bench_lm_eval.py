"""lm-evaluation-harness wall time through ``fastdecode serve`` against lm-eval's own ``hf``
model on the same task and weights (float32, the same tokenizer), and whether the scores agree.

    .venv/bin/python scripts/bench_lm_eval.py                         # the embedded model, fastdecode_mc
    .venv/bin/python scripts/bench_lm_eval.py --task fastdecode_gen   # generate_until through the chat endpoint
    .venv/bin/python scripts/bench_lm_eval.py -- --drafter ngram      # after --: flags for `fastdecode serve`

lm-eval sends ``--batch-size`` prompts a request (8) and keeps ``--num-concurrent`` requests in
flight (8); the server runs them all at once (``--max-num-seqs``, default their product, 64), so
the choices after one question share their prompt's rows in one pass (``Scheduler._shared_prefix``).
``hf`` runs its own batches of ``--batch-size`` (8), computing a question's one-token choices
once (lm-eval's logits cache). Both sides: float32, the same weights and tokenizer, torch's
default thread count, which the server is given as ``--threads`` (its own default would count
the cores lm-eval's client leaves free, and drop to one).

The model is saved once as a float32 Hugging Face directory (``--model-dir``, default under
``~/.cache/fastdecode/lm_eval/``) that both load. Each side's time covers lm-eval's evaluation
only: the server is up and the ``hf`` model loaded before its clock starts. Tasks come from
tests/lm_eval_tasks (written for the repository, no download). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from fastdecode.bench.serve_servers import FASTDECODE, SERVERS, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
NAME = "bench"


def export_model(spec: str, path: Path) -> Path:
    """``spec`` (a fastdecode model spec) as a float32 Hugging Face directory at ``path``."""
    if (path / "config.json").is_file():
        return path
    import torch

    from fastdecode.loading import load_model

    model, tokenizer = load_model(spec, lazy=False)  # saved as a float directory
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def start_server(model_dir: Path, serve_args: list[str], log_path: Path) -> ServerProcess:
    """``fastdecode serve`` on ``model_dir``, started and awaited as ``fastdecode bench-serve`` does."""
    port = free_port()
    command = [sys.executable, "-m", "fastdecode.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--served-model-name", NAME, "--log-level", "warning", *serve_args]
    server = ServerProcess(SERVERS.get(FASTDECODE), command, port, log_path)
    try:
        server.wait_ready(timeout_s=300, deadline=float("inf"))
    except BaseException:
        server.stop()
        raise
    return server


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def evaluate(lm, task: str, chat: bool, batch_size: int) -> tuple[float, dict, list[dict]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS))
    t0 = time.perf_counter()
    out = simple_evaluate(
        model=lm, tasks=[task], task_manager=manager, log_samples=True, apply_chat_template=chat, batch_size=batch_size
    )
    wall_s = time.perf_counter() - t0
    return wall_s, out["results"][task], sorted(out["samples"][task], key=lambda s: s["doc_id"])


def compare(task: str, served: tuple, hf: tuple) -> None:
    (served_s, served_res, served_samples), (hf_s, hf_res, hf_samples) = served, hf
    print(f"task {task}: {len(served_samples)} documents")
    print(f"  lm-eval through fastdecode serve: {served_s:8.2f} s   {served_res}")
    print(f"  lm-eval's hf model:               {hf_s:8.2f} s   {hf_res}")
    print(f"  hf time / server time: {hf_s / served_s:.2f}x")
    if task == "fastdecode_gen":
        same = sum(a["filtered_resps"][0] == b["filtered_resps"][0] for a, b in zip(served_samples, hf_samples))
        print(f"  identical completions: {same}/{len(served_samples)}")
        return
    worst = max(
        abs(float(x[0]) - float(y[0]))
        for a, b in zip(served_samples, hf_samples)
        for x, y in zip(a["filtered_resps"], b["filtered_resps"])
    )
    print(f"  max |log-likelihood difference| over every choice: {worst:.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="fastdecode model spec to export (default %(default)s)")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="float32 HF directory (made from --model if absent)"
    )
    parser.add_argument("--task", default="fastdecode_mc", choices=["fastdecode_mc", "fastdecode_gen"])
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval's batch size, both sides (chat: 1)")
    parser.add_argument(
        "--num-concurrent",
        type=int,
        default=8,
        help="requests lm-eval keeps in flight to the server (default %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the server's --max-num-seqs (default: --batch-size x --num-concurrent, every prompt in flight at once)",
    )
    parser.add_argument("serve_args", nargs="*", help="after --: flags for fastdecode serve")
    args = parser.parse_args(argv)
    max_num_seqs = args.max_num_seqs or args.batch_size * args.num_concurrent
    # The server gets hf's thread count: its default follows the cores other processes leave free
    # (kernels/threads.py), and lm-eval's client on the same machine takes enough CPU to drop it
    # to one thread (measured: 0.81x of hf by default, 1.04x with hf's 2), so the same count on
    # both sides is the fair comparison.
    serve_args = ["--max-num-seqs", str(max_num_seqs), "--threads", str(torch_threads()), *args.serve_args]
    model_dir = args.model_dir or Path.home() / ".cache" / "fastdecode" / "lm_eval" / f"{args.model}-float32"
    model_dir = export_model(args.model, model_dir)
    chat = args.task == "fastdecode_gen"

    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    os.environ["HF_HUB_OFFLINE"] = "1"  # the served model and lm-eval read local files only
    print(
        f"settings: float32 {model_dir}; lm-eval batch size {args.batch_size}, {args.num_concurrent} requests in "
        f"flight; fastdecode serve {' '.join(serve_args)}; hf: HFLM(dtype=float32, device=cpu, "
        f"batch_size={args.batch_size}); torch threads {torch_threads()}"
    )
    server = start_server(model_dir, serve_args, model_dir.parent / "serve.log")
    url = server.url
    try:
        if chat:
            client = LocalChatCompletion(
                model=NAME, base_url=url + "/v1/chat/completions", max_gen_toks=12, num_concurrent=args.num_concurrent
            )
        else:
            client = LocalCompletionsAPI(
                model=NAME,
                base_url=url + "/v1/completions",
                tokenizer=str(model_dir),
                tokenizer_backend="huggingface",
                batch_size=args.batch_size,
                num_concurrent=args.num_concurrent,
            )
        served = evaluate(client, args.task, chat, 1 if chat else args.batch_size)
    finally:
        server.stop()
    hf_lm = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=args.batch_size)
    compare(args.task, served, evaluate(hf_lm, args.task, chat, args.batch_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
