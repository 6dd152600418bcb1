"""The package's shape, as issues 25 and 40 state it: no import cycles among ``fastdecode``'s
modules, no module importing a room above its own (the floors below), at most 8 modules at
the top level, no source file over 600 lines, no function over 80; and the benchmark runs
that docs/ cite are there, with none left that nothing cites.

These read the source with ``ast`` and import nothing from it. Each failure lists
every offender, so one run shows all that is left to fix.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "fastdecode"

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _source_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _parse(path: Path) -> ast.Module:
    return _parse_text(path.read_text(encoding="utf-8"), str(path))


@functools.cache
def _parse_text(text: str, filename: str) -> ast.Module:
    """Parsed once per text: several checks walk every source file (they only read the tree)."""
    return ast.parse(text, filename=filename)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------- the import graph


def _module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src/<package>. A package's
    ``__init__.py`` is the package itself, and wins over a same-named ``.py`` beside it,
    as it does for Python's import system."""
    modules: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py"), key=lambda p: p.name != "__init__.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.setdefault(".".join(parts), path)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``node``, at any depth (in functions too), except
    those only type checkers run (the body of ``if TYPE_CHECKING:``; its ``else:`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _imports(child)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` if it is one of the package's modules, else its longest prefix that is
    (``fastdecode.x.CONSTANT`` -> ``fastdecode.x``); None outside the package."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _targets(stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``stmt``, in ``module``, imports."""
    if isinstance(stmt, ast.Import):
        return {t for alias in stmt.names if (t := _known(alias.name, modules))}
    if stmt.level:  # relative: level 1 is the module's own package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (stmt.level - 1)]
        source = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        source = stmt.module or ""
    out = set()
    for alias in stmt.names:
        submodule = f"{source}.{alias.name}"
        # ``from pkg import name`` imports pkg/name.py when there is one, else a name of pkg.
        target = submodule if submodule in modules else _known(source, modules)
        if target:
            out.add(target)
    return out


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """module -> {imported module -> ["path:line", ...]}, within the package, self-imports left out."""
    modules = _module_files(src, package)
    graph: dict[str, dict[str, list[str]]] = {name: {} for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for stmt in _imports(_parse(path)):
            for target in _targets(stmt, name, is_package, modules):
                if target != name:
                    where = path.relative_to(src.parent).as_posix()
                    graph[name].setdefault(target, []).append(f"{where}:{stmt.lineno}")
    return graph


def strongly_connected_components(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components sorted, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def import_cycles(src: Path = SRC, package: str = PACKAGE) -> list[str]:
    """One entry per cycle (a strongly connected component of more than one module):
    its modules, then each import that keeps it closed, with where it is."""
    graph = import_graph(src, package)
    out = []
    for component in strongly_connected_components(graph):
        if len(component) < 2:
            continue
        members = set(component)
        edges = [
            f"    {a} -> {b}  ({', '.join(where)})"
            for a in component
            for b, where in sorted(graph[a].items())
            if b in members
        ]
        out.append(" <-> ".join(component) + "\n" + "\n".join(edges))
    return out


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, (
        f"{len(cycles)} import cycle(s) among {PACKAGE}'s modules (imports in functions count; "
        "`if TYPE_CHECKING:` ones do not):\n" + "\n".join(cycles)
    )


def test_the_import_graph_reads_every_kind_of_import(tmp_path):
    """The checker itself, on a made-up package: absolute, relative and function-level
    imports count; ``from pkg import sub`` is pkg/sub.py; TYPE_CHECKING imports do not."""
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from . import b\nA = 1\n",
        "pkg/b.py": "def f():\n    from .sub.c import C\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.sub\nfrom .. import a\nC = 1\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\nelse:\n    import os\nD = 1\n",
        "pkg/e.py": "from pkg import d\nfrom pkg.d import D as _\nimport json\nE = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = {m: sorted(t) for m, t in import_graph(tmp_path, "pkg").items()}
    assert graph == {
        "pkg": ["pkg.a"],
        "pkg.a": ["pkg.b"],
        "pkg.b": ["pkg.sub.c"],
        "pkg.sub": [],
        "pkg.sub.c": ["pkg.a", "pkg.sub"],
        "pkg.d": [],
        "pkg.e": ["pkg.d"],
    }
    cycles = import_cycles(tmp_path, "pkg")
    assert [c.splitlines()[0] for c in cycles] == ["pkg.a <-> pkg.b <-> pkg.sub.c"]
    assert f"pkg.b -> pkg.sub.c  ({tmp_path.name}/pkg/b.py:2)" in cycles[0]


# ---------------------------------------------------------------- rooms and floors

# fastdecode's rooms from the ground up, as docs/architecture.md draws them. A room is a top-level
# module or package (named as imported, less "fastdecode."; "__init__" is the package itself), or
# a module of a package that stands on another floor than the rest of it: the longest name that
# holds a module is its room. A module may import its own room and any room on its floor or
# below, never one above (imports in functions count): data flows up, and nothing downstream is
# imported upstream.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("__init__", "errors"),  # __init__ imports its public names on first use, by name
    ("registry", "data", "util", "architectures"),  # architectures: the decoders described, as data
    ("kernels", "loaders"),  # loaders: model files read as skeletons whose tensors the kernels take
    ("formats", "quant"),  # a format registers quant's handlers; the methods pack into the formats
    ("kv",),
    ("loading", "backends"),
    ("kv.policy", "decoding"),  # above the backends: they serve a policy through kv.attention
    ("drafters",),
    ("engine",),
    ("args",),
    ("api", "evaluation", "distill", "server", "scaleout"),  # `serve --replicas` runs the server on Ray
    ("bench",),
    ("cli", "__main__"),
)
FLOOR = {room: number for number, rooms in enumerate(FLOORS) for room in rooms}
MAX_TOP_LEVEL_MODULES = 8  # __init__, __main__ and the public entry points


def room_of(module: str) -> str:
    """The room of ``module``, a dotted name in the package: ``fastdecode.kv.policy`` -> ``kv.policy``,
    ``fastdecode.kv.cache`` -> ``kv``, ``fastdecode`` -> ``__init__``."""
    parts = module.split(".")[1:] or ["__init__"]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in FLOOR:
            return ".".join(parts[:end])
    return parts[0]


def _top_level() -> list[str]:
    return sorted(p.stem if p.is_file() else p.name for p in (SRC / PACKAGE).iterdir() if _is_module(p))


def _is_module(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".py") or (path / "__init__.py").is_file()


def test_every_room_stands_on_a_floor():
    top = _top_level()
    unplaced = [name for name in top if name not in FLOOR]
    modules = _module_files(SRC, PACKAGE)
    missing = [room for room in FLOOR if f"{PACKAGE}.{room}".removesuffix(".__init__") not in modules]
    assert not unplaced, f"room(s) of {PACKAGE} on no floor of FLOORS (place each): {', '.join(unplaced)}"
    assert not missing, f"FLOORS names room(s) that are not modules of {PACKAGE}: {', '.join(missing)}"


def test_no_module_imports_a_room_above_it():
    offenders = [
        f"{module} ({room_of(module)}, floor {FLOOR[room_of(module)]}) -> {target} "
        f"({room_of(target)}, floor {FLOOR[room_of(target)]})  ({', '.join(where)})"
        for module, targets in sorted(import_graph().items())
        for target, where in sorted(targets.items())
        if room_of(module) in FLOOR and room_of(target) in FLOOR and FLOOR[room_of(target)] > FLOOR[room_of(module)]
    ]
    assert not offenders, (
        f"{len(offenders)} import(s) of a room above the importer's (tests/test_layout.py FLOORS; "
        "pass an interface down instead):\n" + "\n".join(offenders)
    )


def test_the_top_level_holds_the_entry_points_only():
    modules = [p.name for p in sorted((SRC / PACKAGE).glob("*.py"))]
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(modules)} modules at the top of src/{PACKAGE} (at most {MAX_TOP_LEVEL_MODULES}; "
        f"give the rest a room): {', '.join(modules)}"
    )


def test_room_of_takes_the_longest_name_on_a_floor():
    assert room_of("fastdecode") == "__init__"
    assert room_of("fastdecode.errors") == "errors"
    assert room_of("fastdecode.kv.cache") == "kv"
    assert room_of("fastdecode.kv.policy") == "kv.policy"
    assert room_of("fastdecode.engine.scheduler") == "engine"
    assert FLOOR["kv.policy"] > FLOOR["backends"] > FLOOR["kv"]


# ---------------------------------------------------------------- sizes


def long_files() -> list[str]:
    out = []
    for path in _source_files():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_FILE_LINES:
            out.append(f"{_rel(path)}: {lines} lines")
    return out


def long_functions() -> list[str]:
    out = []
    for path in _source_files():
        tree = _parse(path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                qualname, up = [node.name], parents.get(node)
                while up is not None and not isinstance(up, ast.Module):
                    if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        qualname.insert(0, up.name)
                    up = parents.get(up)
                out.append(f"{_rel(path)}:{node.lineno} {'.'.join(qualname)}: {lines} lines")
    return out


def test_no_source_file_over_600_lines():
    offenders = long_files()
    assert not offenders, f"{len(offenders)} file(s) in src/ over {MAX_FILE_LINES} lines:\n" + "\n".join(offenders)


def test_no_function_over_80_lines():
    offenders = long_functions()
    assert not offenders, (
        f"{len(offenders)} function(s) in src/ over {MAX_FUNCTION_LINES} lines (def to last line):\n"
        + "\n".join(offenders)
    )


# ---------------------------------------------------------------- benchmark runs the docs cite

# Every page but architecture.md, whose ``bench/`` is the package's folder, not a run.
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md")]
BENCH = ROOT / "docs" / "bench"
# A path under docs/bench as the docs write it: "docs/bench/zen3/x", or "bench/zen3/x/report.md"
# relative to docs/ (a path inside the package, src/fastdecode/bench/, is preceded by "fastdecode/").
_CITED = re.compile(r"(?<![\w/])(?:docs/)?bench/([\w.+-]+(?:/[\w.+-]+)*)/?")


def cited_bench_paths() -> dict[str, list[str]]:
    """Path relative to docs/bench -> where the docs cite it ("file:line")."""
    cited: dict[str, list[str]] = {}
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in _CITED.finditer(line):
                cited.setdefault(match.group(1).rstrip("."), []).append(f"{_rel(doc)}:{number}")
    return cited


def _runs() -> list[str]:
    """What the docs should cite under docs/bench: each run folder (one holding a
    report) and each loose file, relative to docs/bench."""
    runs = set()
    for path in BENCH.rglob("*"):
        if path.is_file() and path.parent == BENCH:
            runs.add(path.name)
        elif path.is_file() and path.name in ("report.md", "results.md"):
            runs.add(path.parent.relative_to(BENCH).as_posix())
        elif path.is_file() and path.suffix == ".md" and not (path.parent / "report.md").exists():
            runs.add(path.relative_to(BENCH).as_posix())  # a probe's table, e.g. zen3/probe.md
    return sorted(runs)


def test_cited_bench_paths_exist():
    missing = [
        f"docs/bench/{p} (cited at {', '.join(where)})"
        for p, where in sorted(cited_bench_paths().items())
        if not (BENCH / p).exists()
    ]
    assert not missing, f"{len(missing)} cited path(s) under docs/bench/ missing:\n" + "\n".join(missing)


def test_every_bench_run_is_cited():
    cited = cited_bench_paths()

    def is_cited(run: str) -> bool:  # the run itself, a file in it, or a folder holding it (policy-ab-s10/)
        return any(p == run or p.startswith(run + "/") or run.startswith(p + "/") for p in cited)

    stale = [f"docs/bench/{run}" for run in _runs() if not is_cited(run)]
    assert not stale, (
        f"{len(stale)} run(s) under docs/bench/ that no page of README.md or docs/ cites "
        "(superseded: delete them, or cite the figure they back):\n" + "\n".join(stale)
    )
