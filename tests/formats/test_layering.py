"""The weights stack imports one way: kernels at the bottom, the weight formats and ``quant``
above them, ``loading`` above those. The graph is read from the source (module- and
function-level imports alike), so an import hidden in a function counts too."""

import ast
import functools
from pathlib import Path

import pytest

import fastdecode

SRC = Path(fastdecode.__file__).parent.parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in SRC.joinpath("fastdecode").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@functools.cache  # every test reads the same source; they only read the graph
def _graph(naive: bool) -> dict[str, set[str]]:
    """module -> the modules it imports. ``from a import b`` is a.b when that is a module,
    else a; ``naive``: always a (so importing through a package's ``__init__`` counts)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                edges.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    edges.add(full if full in modules and not naive else known(base))
        graph[module] = {e for e in edges if e and e != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


WEIGHTS_STACK = (
    "fastdecode.kernels",
    "fastdecode.quant",
    "fastdecode.formats",
    "fastdecode.loading",
    "fastdecode.backends.linear",
)


def _in(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("naive", [False, True], ids=["submodules", "through-packages"])
def test_no_import_cycle_touches_the_weights_stack(naive):
    cycles = [sorted(c) for c in _cycles(_graph(naive)) if any(_in(m, WEIGHTS_STACK) for m in c)]
    assert cycles == []


@pytest.mark.parametrize(
    "lower, above",
    [
        (
            ("fastdecode.kernels",),
            ("fastdecode.quant", "fastdecode.formats", "fastdecode.loading", "fastdecode.backends"),
        ),
        (
            ("fastdecode.quant", "fastdecode.formats"),
            ("fastdecode.loading", "fastdecode.backends", "fastdecode.engine", "fastdecode.drafters", "fastdecode.cli"),
        ),
        (("fastdecode.quant.math",), ("fastdecode.kernels", "fastdecode.formats", "fastdecode.quant.linear")),
    ],
)
def test_a_lower_layer_imports_nothing_above_it(lower, above):
    graph = _graph(naive=True)
    wrong = {m: sorted(t for t in targets if _in(t, above)) for m, targets in graph.items() if _in(m, lower)}
    assert {m: t for m, t in wrong.items() if t} == {}
