"""The packages import one another one way: no import cycle, and each layer only downwards.

The layers, from the bottom: ``shared`` (the math and the contracts) imports none of the
others; ``client`` (the on-device SDK) and ``aggregator`` (the service) import ``shared``
and never each other nor ``simulations``; ``simulations`` may import all three. The
client is embedded in apps, so importing it must not load FastAPI, SQLAlchemy, SciPy or
uvicorn (``tests/client/test_client_imports.py`` checks the same in a fresh interpreter).

The graph is read statically from the source (``ast``). An edge A -> B is any import of a
project module B executed by A: at module level and inside functions alike (a lazy
import that closes a cycle still makes two modules depend on each other), except under
``if TYPE_CHECKING:``, which never runs. ``from p import name`` is an edge to ``p``, and
to ``p.name`` when that is a module. The implicit import of a package's ``__init__`` by
importing one of its submodules is not an edge of the cycle check: it is how Python loads
packages, not a dependency the code chose; it does count for what an import loads.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "client", "aggregator", "simulations")
#: What each package must never import (at module level or lazily).
FORBIDDEN = {
    "shared": {"client", "aggregator", "simulations"},
    "client": {"aggregator", "simulations"},
    "aggregator": {"client", "simulations"},
    "simulations": set(),
}
#: Server-side libraries the client must not load when it is imported.
SERVER_SIDE = {"fastapi", "sqlalchemy", "scipy", "uvicorn"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST, *, at_import_time: bool = False) -> set[str]:
    """Every module name ``tree`` imports when it runs (see the module doc): absolute
    imports, ``from p import name`` as both ``p`` and ``p.name``. With ``at_import_time``
    only those that run when the module is imported (not inside a function)."""
    found: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if at_import_time and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        pending.extend(  # an import is a statement: expressions hold none
            child
            for child in ast.iter_child_nodes(node)
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case)
        )
    return found


def imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The project modules among ``modules`` that ``tree`` imports when it runs."""
    return imports(tree) & modules


@functools.cache
def sources() -> dict[str, ast.AST]:
    """Module name -> syntax tree, for every module of the four packages (read once)."""
    return {
        module_name(path): ast.parse(path.read_text(), str(path))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


@functools.cache
def import_graph() -> dict[str, set[str]]:
    trees = sources()
    modules = set(trees)
    return {name: imported(tree, modules) - {name} for name, tree in trees.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def packages_of(name: str) -> list[str]:
    """``a.b.c`` -> [``a``, ``a.b``]: the packages Python loads before module ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def loaded_on_import(start: str, trees: Mapping[str, ast.AST]) -> dict[str, str]:
    """Every module name (project or not) loaded by ``import start``, each with the
    project module that imports it: module-level imports followed through the project's
    modules and their packages' ``__init__``."""
    via: dict[str, str] = {}
    pending = [start]
    seen = {start}
    while pending:
        current = pending.pop()
        names = imports(trees[current], at_import_time=True) | set(packages_of(current))
        for name in sorted(names):
            for loaded in (*packages_of(name), name):
                via.setdefault(loaded, current)
                if loaded in trees and loaded not in seen:
                    seen.add(loaded)
                    pending.append(loaded)
    return via


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert {"shared.schemas", "client", "aggregator.app", "simulations.cli"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_each_package_imports_only_the_layers_below_it() -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target.split(".")[0] in FORBIDDEN[module.split(".")[0]]
    )
    assert not wrong, "imports across the layers: " + "; ".join(wrong)


def test_importing_the_client_loads_no_server_side_library() -> None:
    trees = sources()
    wrong = sorted(
        f"{module} loads {name} (imported by {importer})"
        for module in trees
        if module.split(".")[0] == "client"
        for name, importer in loaded_on_import(module, trees).items()
        if name.split(".")[0] in SERVER_SIDE
    )
    assert not wrong, "the client must stay light: " + "; ".join(wrong)


def test_the_graph_sees_lazy_imports_and_skips_type_checking_ones() -> None:
    modules = {"shared.a", "shared.b", "shared.c"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shared.c import C\n"
        "def f():\n    from shared import b\n"
    )
    assert imported(ast.parse(source), modules) == {"shared.b"}
    assert find_cycle({"shared.a": {"shared.b"}, "shared.b": {"shared.a"}}) == [
        "shared.a",
        "shared.b",
        "shared.a",
    ]
    assert find_cycle({"shared.a": {"shared.b"}, "shared.b": set()}) is None


def test_what_an_import_loads_follows_module_level_imports_and_packages() -> None:
    trees = {
        "client": ast.parse(""),
        "client.a": ast.parse("import json\nfrom shared.b import f\ndef g():\n    import scipy\n"),
        "shared": ast.parse(""),
        "shared.b": ast.parse("class K:\n    import fastapi\n"),
    }
    loaded = loaded_on_import("client.a", trees)
    assert loaded["fastapi"] == "shared.b" and loaded["shared"] == "client.a"
    assert "json" in loaded and "scipy" not in loaded
