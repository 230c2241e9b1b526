"""The modules of ``shared`` import one another one way: no import cycle.

The graph is read statically from the source (``ast``). An edge A -> B is any import of
``shared`` module B executed by A: at module level and inside functions alike (a lazy
import that closes a cycle still makes two modules depend on each other), except under
``if TYPE_CHECKING:``, which never runs. ``from shared.p import name`` is an edge to
``shared.p``, and to ``shared.p.name`` when that is a module. The implicit import of a
package's ``__init__`` by importing one of its submodules is not an edge: it is how
Python loads packages, not a dependency the code chose.
"""

from __future__ import annotations

import ast
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SHARED.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(tree: ast.AST, modules: set[str]) -> set[str]:
    """The ``shared`` modules that ``tree`` imports when it runs (see the module doc)."""
    found: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        pending.extend(ast.iter_child_nodes(node))
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = sorted(SHARED.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {
        module_name(path): imported(ast.parse(path.read_text(), str(path)), modules)
        - {module_name(path)}
        for path in paths
    }


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


def test_the_shared_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert "shared.schemas" in graph and "shared.mechanisms.rappor" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among shared modules: " + " -> ".join(cycle or [])


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
