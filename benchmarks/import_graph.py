"""The package's modules and their import graph: what ``benchmarks.house_figures`` reports
and ``tests/test_import_cycles.py`` checks (standard library only, no import of pippy_split).

An edge A -> B for every ``import`` / ``from ... import`` in A that names B, a module of
the package: relative imports resolved, ``from P import n`` pointing at ``P.n`` when that is
a module, else at ``P``. The parent packages Python initialises on the way are not edges.
Three kinds: *runtime* (run when A is imported: the module body, including ``if`` / ``try``
and class bodies), *type-only* (under ``if TYPE_CHECKING:``) and *local* (inside a function
body; a cycle that only these close was dodged at import time, the modules still lean on
each other).

Example:
    >>> graph = import_graph()
    >>> cycles(graph.runtime)
    []
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

__all__ = ["Module", "modules", "ImportGraph", "import_graph", "function_level_imports", "cycles",
           "type_only_cycles", "dodged_cycles"]

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "pippy_split"


# ---- the package's modules -------------------------------------------------------------


@dataclass
class Module:
    """One module of the package, parsed."""

    name: str  # dotted, e.g. "pippy_split.schedule.lower"
    path: Path
    tree: ast.Module
    is_package: bool  # an __init__.py

    @property
    def package(self) -> str:
        """The package (directory) this module sits in."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def lines(self) -> int:
        return len(self.path.read_text().splitlines())


def modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Module]:
    """Every ``.py`` module under ``package_dir``, by dotted name."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = Module(".".join(parts), path, ast.parse(path.read_text(), str(path)), is_package)
    return out


# ---- (a) the import graph ----------------------------------------------------------------


@dataclass
class ImportGraph:
    """Module-level import edges inside the package: runtime ones and ``TYPE_CHECKING`` ones."""

    runtime: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    type_only: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    local: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Imports inside function bodies (not module-level; a cycle they close is one dodged)."""


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt], type_only: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """``(import statement, under TYPE_CHECKING?)`` run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif isinstance(node, ast.If):
            yield from _module_level_imports(node.body, type_only or _is_type_checking(node.test))
            yield from _module_level_imports(node.orelse, type_only)
        elif isinstance(node, (ast.Try, ast.With, ast.For, ast.While, ast.ClassDef)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level_imports(getattr(node, block, []), type_only)
            for handler in getattr(node, "handlers", []):
                yield from _module_level_imports(handler.body, type_only)


def _targets(node: ast.stmt, mod: Module, known: dict[str, Module]) -> set[str]:
    """The package's modules one import statement names (see the module docstring)."""
    if isinstance(node, ast.Import):
        out = set()
        for alias in node.names:
            parts = alias.name.split(".")
            prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            out |= {next((p for p in prefixes if p in known), "")} - {""}
        return out
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        anchor = mod.package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif base in known:
            out.add(base)
    return out


def import_graph(mods: dict[str, Module] | None = None) -> ImportGraph:
    """The module-level import edges between the package's modules."""
    mods = modules() if mods is None else mods
    graph = ImportGraph()
    for mod in mods.values():
        for node, type_only in _module_level_imports(mod.tree.body):
            for target in _targets(node, mod, mods) - {mod.name}:
                (graph.type_only if type_only else graph.runtime)[mod.name].add(target)
        for node in function_level_imports(mod.tree):
            graph.local[mod.name] |= _targets(node, mod, mods) - {mod.name}
    return graph


def function_level_imports(tree: ast.Module) -> Iterator[ast.stmt]:
    """Import statements inside function bodies (each once, however deep the nesting)."""
    seen: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                    seen.add(id(node))
                    yield node


def cycles(edges: dict[str, set[str]], limit: int = 200) -> list[list[str]]:
    """Elementary cycles of ``edges`` (each from its smallest module, at most ``limit``)."""
    nodes = sorted(set(edges) | {t for ts in edges.values() for t in ts})
    found: list[list[str]] = []
    for start in nodes:
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack and len(found) < limit:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    found.append(path)
                elif nxt > start and nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return found


def _merged(a: dict[str, set[str]], b: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for edges in (a, b):
        for src, targets in edges.items():
            out[src] |= targets
    return out


def type_only_cycles(graph: ImportGraph) -> list[list[str]]:
    """Cycles that close only through a ``TYPE_CHECKING`` import."""
    runtime = {tuple(c) for c in cycles(graph.runtime)}
    return [c for c in cycles(_merged(graph.runtime, graph.type_only)) if tuple(c) not in runtime]


def dodged_cycles(graph: ImportGraph) -> list[list[str]]:
    """Cycles that close only through a function-local import (the import was moved into a
    function to break the cycle at import time; the modules still depend on each other)."""
    module_level = {tuple(c) for c in cycles(_merged(graph.runtime, graph.type_only))}
    every = cycles(_merged(_merged(graph.runtime, graph.type_only), graph.local))
    return [c for c in every if tuple(c) not in module_level]
