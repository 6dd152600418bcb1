"""Shared fixtures: a tiny random-weight Llama, a character-level tokenizer, and
test-only drafters whose accept pattern is known in advance.

The model is built from a config (no download) and is small enough that a
whole generation takes milliseconds on a CPU. Test modules reach the helpers
through fixtures, never ``from conftest import``: another conftest.py
(tests/integration/) would make that import ambiguous.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest
import torch

from fastdecode.drafters.base import Draft, Drafter

VOCAB_SIZE = 96
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
CONTEXT_LENGTH = 128
MODEL_SEED = 0

# The tiny model is far too small to gain from intra-op threads; on a busy
# 2-core machine their synchronisation made each forward pass ~20x slower.
# Integration tests (tests/integration/conftest.py) restore the default.
# Under pytest-xdist (pyproject's addopts run one worker per core), the workers share the
# cores: an integration test gets its worker's share, so that two workers' thread pools never
# oversubscribe the machine (spinning OpenMP threads on a shared core made passes many times slower).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
DEFAULT_NUM_THREADS = max(1, torch.get_num_threads() // _WORKERS)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_num_threads():
    return DEFAULT_NUM_THREADS


@pytest.fixture(autouse=True)
def _unit_tests_start_on_one_thread(request):
    """Each unit test starts on one intra-op thread, as the session did: a command run in this
    process with ``--threads`` (tests/cli/test_cli.py) sizes torch's pool for the process, and
    every later test then ran on all the cores."""
    if request.node.get_closest_marker("integration") is None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


# ---------------------------------------------------------------- the C library

# After an edit of the C sources the library's first build takes over a minute of one core. It is
# started when the session starts, beside collection (which would otherwise wait for it when the
# first kernel test module asks whether the library is there: fastdecode.kernels.build lets one
# build of a key run at a time, and a second caller waits for it), and awaited before the first
# test, so that no test's own view of the loader (tests/kernels/test_cpu.py clears its cache)
# meets a build still under way.
_library_build: threading.Thread | None = None


def pytest_sessionstart(session):
    global _library_build
    from fastdecode.kernels import cpu

    _library_build = threading.Thread(target=cpu.rowgemm_unavailable, name="library-build", daemon=True)
    _library_build.start()


def pytest_collection_finish(session):
    if _library_build is not None:
        _library_build.join()


# ---------------------------------------------------------------- integration tests

# A test is an integration test by what it uses, decided here and nowhere else, so that
# `pytest -m "not integration"` is the fast unit run: no real model, no Ray, no browser.
# tests/integration/ holds the tests of the real models (the embedded SmolLM2-135M, the
# optional Gemma 3); elsewhere a test that needs one of these asks for its fixture. So does a
# whole-system run: a fastdecode process (a server, the command line) started and driven from
# outside, whose parts the unit tests call in this process.
INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"
INTEGRATION_FIXTURES = {
    "smollm2": "the embedded model (tests/integration/conftest.py)",
    "smollm2_model": "the embedded model behind a server (tests/server/conftest.py)",
    "smollm2_tokenizer": "the embedded model's tokenizer, read from its GGUF file",
    "embedded_model_name": "the command line run on the embedded model",
    "ray_cluster": "a Ray cluster (tests/scaleout/conftest.py)",
    "browser": "a browser driven by Selenium (tests/server/test_browser.py)",
    "child_process_env": "a fastdecode process started and driven from outside: a whole-system run",
}


# Under pytest-xdist (pyproject: ``--dist loadgroup``) each test module runs on one worker, so that
# what a module builds once (a module-scoped fixture, a cache of parsed sources) is built once per
# run, not once on each worker that got one of its tests. Tests that would contend for one
# machine-wide resource run on one worker, one after another, whatever their module: Ray clusters
# (each asks for every core), the browser. The scheduler (below) sees test ids only, so a group is
# given by module, and collection checks that every test using a group's fixture is in one of them.
XDIST_GROUPS = {"ray_cluster": "ray", "browser": "browser"}
GROUP_MODULES = {
    "tests/scaleout/test_ray_batch.py": "ray",
    "tests/scaleout/test_ray_serve.py": "ray",
    "tests/server/test_browser.py": "browser",
}


def xdist_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's group, else its module."""
    module = nodeid.split("::", 1)[0]
    return GROUP_MODULES.get(module, module)


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist: none without it, -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` by module: xdist's own reads ``xdist_group`` marks from a suffix it adds to
    each test's id, which pytest 9.2's ids no longer take (every test was then scheduled alone).
    Units are handed out most tests first (xdist's --loadscope-reorder)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION_DIR in item.path.parents or not INTEGRATION_FIXTURES.keys().isdisjoint(item.fixturenames):
            item.add_marker(pytest.mark.integration)
        for fixture, group in XDIST_GROUPS.items():
            if fixture in item.fixturenames and xdist_unit(item.nodeid) != group:
                raise pytest.UsageError(
                    f"{item.nodeid} uses {fixture}: add its module to tests/conftest.py GROUP_MODULES as {group!r}"
                )


@pytest.fixture
def short_evaluation_text(monkeypatch):
    """The built-in evaluation text (``fastdecode.data.corpora.evaluation_text``, WikiText-2's
    1.3M characters) cut to its first 64K characters, for a test of a command that scores a
    window or two from its start: those windows' tokens are the same, and the whole text,
    tokenized on every call, took ~1 s a call with the tests' character-level tokenizers."""
    from fastdecode.data import corpora

    text = corpora.evaluation_text()[: 1 << 16]
    monkeypatch.setattr(corpora, "evaluation_text", lambda: text)
    return text


@pytest.fixture(scope="session")
def embedded_model_name():
    """The embedded model's built-in name, for a test that runs the command line on it (in this
    process or another): asking for it makes the test an integration test."""
    from fastdecode.loading import DEFAULT_MODEL

    return DEFAULT_MODEL


@pytest.fixture
def child_process_env():
    """The environment for a fastdecode process a test starts (a server, the command line): this
    one's, with the sources this process imported first on the child's path, however pytest was
    started. Asking for it makes the test an integration test (a whole-system run)."""
    import fastdecode

    src = str(Path(fastdecode.__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))


class CharTokenizer:
    """Each id >= 3 is one printable ASCII character; 0, 1, 2 are pad, bos, eos.

    Implements only what the engine uses: ``decode``, ``__call__``,
    ``eos_token_id`` and ``chat_template`` (always ``None``: no template).
    """

    SPECIAL = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}

    def __init__(self, vocab_size: int = VOCAB_SIZE, eos_token_id: int = EOS_ID) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = BOS_ID
        self.pad_token_id = PAD_ID
        self.chat_template = None
        # ids 3.. -> " ", "!", '"', ... : 93 distinct printable characters
        self.id_to_char = {i: chr(32 + i - 3) for i in range(3, vocab_size)}
        self.char_to_id = {c: i for i, c in self.id_to_char.items()}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            special = i in self.SPECIAL or i == self.eos_token_id
            if special:
                if not skip_special_tokens:
                    out.append(self.SPECIAL.get(i, f"<{i}>"))
            else:
                out.append(self.id_to_char[i])
        return "".join(out)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [self.char_to_id[c] for c in text]
        if add_special_tokens and ids:
            ids = [BOS_ID, *ids]
        return {"input_ids": ids}


def build_tiny_llama(eos_token_id: int = EOS_ID, seed: int = MODEL_SEED):
    from tiny_models import tiny_llama

    return tiny_llama(
        seed,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=CONTEXT_LENGTH,
        eos_token_id=eos_token_id,
        bos_token_id=BOS_ID,
        pad_token_id=PAD_ID,
    )


def with_eos(model, eos_token_id: int):
    """A copy of ``model`` (same weights) whose EOS id is ``eos_token_id``."""
    clone = copy.deepcopy(model)
    clone.config.eos_token_id = eos_token_id
    clone.generation_config.eos_token_id = eos_token_id
    return clone


@pytest.fixture(scope="session")
def tiny_model():
    return build_tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    return CharTokenizer()


class OracleDrafter(Drafter):
    """Drafts from a known continuation: the plain greedy output, given up front.

    ``reference`` is the whole sequence (prompt followed by the plain greedy
    output); ``propose(context, k)`` returns ``reference[len(context):][:k]``,
    with the draft positions for which ``corrupt(step, i)`` is true replaced
    by a different token. Since the target's greedy choice at each position is
    the reference token, a step accepts exactly the draft prefix before the
    first corrupted position. Records every ``k`` it was handed and every draft.
    """

    name = "oracle-test"  # never registered

    def __init__(
        self,
        reference: Sequence[int],
        corrupt: Callable[[int, int], bool] | Iterable[int] = (),
        vocab_size: int = VOCAB_SIZE,
        ignore_k: bool = False,
    ) -> None:
        self.reference = [int(t) for t in reference]
        if callable(corrupt):
            self.corrupt = corrupt
        else:
            positions = frozenset(corrupt)
            self.corrupt = lambda step, i: i in positions
        self.vocab_size = vocab_size
        self.ignore_k = ignore_k  # propose more than asked (the loop must cut it)
        self.requested_k: list[int] = []
        self.drafts: list[list[int]] = []
        self.observed: list[tuple[list[int], int]] = []
        self.begun: list[list[int]] = []

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.begun.append(list(prompt_ids))

    def propose(self, context: Sequence[int], k: int) -> Draft:
        step = len(self.requested_k)
        self.requested_k.append(k)
        assert list(context) == self.reference[: len(context)], "context left the reference"
        tokens = self.reference[len(context) :][: (k + 5 if self.ignore_k else k)]
        tokens = [(t + 1) % self.vocab_size if self.corrupt(step, i) else t for i, t in enumerate(tokens)]
        self.drafts.append(tokens)
        return Draft(tokens)

    def observe(self, new_tokens: Sequence[int], num_accepted: int) -> None:
        self.observed.append((list(new_tokens), num_accepted))


class EmptyDrafter(Drafter):
    """Never proposes anything: speculative decoding degenerates to plain."""

    name = "empty-test"

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self.calls += 1
        return Draft([])


@pytest.fixture(scope="session")
def oracle_drafter():
    """The :class:`OracleDrafter` class: ``oracle_drafter(reference, corrupt=...)``."""
    return OracleDrafter


@pytest.fixture
def empty_drafter():
    return EmptyDrafter()


@pytest.fixture(scope="session")
def eos_variant(tiny_model):
    """``eos_variant(eos_id)`` -> (model, tokenizer): the tiny model's weights with
    ``eos_id`` as the end-of-sequence token."""

    def make(eos_token_id: int):
        return with_eos(tiny_model, eos_token_id), CharTokenizer(eos_token_id=eos_token_id)

    return make


@pytest.fixture(scope="session")
def smollm2_tokenizer(pytestconfig):
    """The embedded model's tokenizer, without its weights.

    Read from the GGUF file it takes ~13 s (transformers parses the vocabulary field
    by field), so it is saved once under pytest's cache and later loaded from there:
    the same tokenizer.json the loader's own cache (fastdecode.loading) keeps.
    """
    import hashlib
    from pathlib import Path

    import transformers
    from transformers import AutoTokenizer

    from fastdecode.loading import resolve_spec

    path = Path(resolve_spec("smollm2-135m").location)
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    cache = getattr(pytestconfig, "cache", None)
    saved = cache.mkdir("smollm2-tokenizer-" + hashlib.sha256(key.encode()).hexdigest()[:16]) if cache else None
    if saved is not None and (saved / "complete").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if saved is not None:
        tokenizer.save_pretrained(str(saved))
        (saved / "complete").write_text("ok\n")
    return tokenizer


@pytest.fixture
def linear_pass_costs(monkeypatch):
    """The batch draft policy's pass cost as a fixed line, T(rows) = 1 + rows / 100, instead
    of the measured one. A test asserting that drafting happened at batch > 1 must not
    depend on how fast this machine ran the tiny model's passes: with measured costs the
    policy rightly declines draft rows that do not pay, and on the tiny model whether they
    pay is a matter of timing noise."""
    from fastdecode.engine import BatchDraftPolicy

    monkeypatch.setattr(BatchDraftPolicy, "cost", lambda self, rows: 1.0 + rows / 100)
