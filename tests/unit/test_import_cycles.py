"""No import cycles inside the kempnerforge package.

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every
import statement anywhere in ``a`` that names ``b`` or a name from it: at module level, under
``TYPE_CHECKING`` and inside functions alike, so moving an import into a function (or behind
``TYPE_CHECKING``) does not hide a circle; it only defers it. A cycle fails the test with one
concrete path through it; break it by moving the shared piece into its own module.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "kempnerforge"


def source_roots() -> dict[str, Path]:
    """Package name -> folder, from pyproject's ``[tool.setuptools.package-dir]`` (strategies/ and
    callbacks/ install as ``kempnerforge.strategies`` / ``kempnerforge.callbacks``)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items() if name.split(".")[0] == PACKAGE}


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (``__init__`` as the package)."""
    roots = source_roots()
    modules: dict[str, Path] = {}
    for name, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            dotted = ".".join([name, *parts])
            # A folder mapped on its own (kempnerforge.strategies) wins over the same name under kempnerforge/.
            if dotted not in modules or path.is_relative_to(roots.get(dotted, folder)):
                modules[dotted] = path
    return modules


def import_edges(name: str, path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that ``name`` (source ``path``) imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, one level up per extra dot
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub`; `from mod import name` imports `mod`.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where c is an attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    """The package's module-level import graph (see the module docstring)."""
    files = module_files()
    names = set(files)
    return {name: import_edges(name, path, names) for name, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _path_within(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle through the component's first module, for the failure message."""
    members, start = set(component), component[0]
    trail, seen = [start], {start}
    while True:
        nxt = sorted(n for n in graph[trail[-1]] if n in members)
        back = [n for n in nxt if n == start]
        if back and len(trail) > 1:
            return [*trail, start]
        fresh = [n for n in nxt if n not in seen]
        if not fresh:
            return [*trail, "..."]
        trail.append(fresh[0])
        seen.add(fresh[0])


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"kempnerforge.cli", "kempnerforge.strategies.kempner", "kempnerforge.callbacks.preemption"} <= set(graph)
    # Spot checks of the edge extraction: absolute imports at module level and inside a function.
    assert "kempnerforge.strategies.cpu_malloc" in graph["kempnerforge.strategies.kempner"]
    assert "kempnerforge.metrics.flops" in graph["kempnerforge.config.model"]
    assert "kempnerforge.cli" in graph["kempnerforge.entry"]  # imported in main


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_find_cycles_on_known_graphs(graph, expected):
    assert find_cycles(graph) == expected


def test_edges_include_type_checking_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nclass A: ...\n"
    )
    (pkg / "b.py").write_text("from . import a\ndef f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    assert import_edges("pkg", pkg / "__init__.py", modules) == {"pkg.a"}
    assert import_edges("pkg.a", pkg / "a.py", modules) == {"pkg.b"}
    assert import_edges("pkg.b", pkg / "b.py", modules) == {"pkg.a", "pkg.c"}  # `from pkg import c` names pkg.c


def test_no_import_cycles_in_kempnerforge():
    graph = import_graph()
    cycles = find_cycles(graph)
    described = ["  " + " -> ".join(_path_within(graph, c)) for c in cycles]
    assert not cycles, "import cycles inside kempnerforge (move the shared piece into its own module):\n" + "\n".join(
        described
    )
