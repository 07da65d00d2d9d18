"""The package's layout: the stages depend on records and interfaces, never on the loader.

Every import between the package's modules counts, type-only and function-level ones included:
an epoch runs from a frozen plan (``_records.Plan``), so no stage needs ``_loader``, and the
import graph has no circle (a reader can follow one batch downward through the file list).
"""

from __future__ import annotations

import ast
from pathlib import Path

import aioloader

PACKAGE = Path(aioloader.__file__).parent


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:  # from ._x import y
                    target = node.module.split(".")[0]
                elif node.level == 0 and (node.module or "").startswith("aioloader."):
                    target = (node.module or "").split(".")[1]
                elif node.level == 1 and node.module is None:  # from . import _x, _y
                    for alias in node.names:
                        if alias.name in modules:
                            graph[name].add(alias.name)
                    continue
                else:
                    continue
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def test_no_module_but_the_package_itself_imports_the_loader() -> None:
    importers = sorted(m for m, deps in _graph().items() if "_loader" in deps)
    assert importers == ["__init__"]


def test_the_import_graph_has_no_circle() -> None:
    graph = _graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
