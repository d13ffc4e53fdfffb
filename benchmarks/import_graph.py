"""The package's modules and their import graph: what ``benchmarks.house_figures`` reports
and ``tests/test_import_cycles.py`` checks (standard library only, no import of pippy_split).

An edge A -> B for every ``import`` / ``from ... import`` in A that names B, a module of
the package: relative imports resolved, ``from P import n`` pointing at ``P.n`` when that is
a module, else at ``P``. The parent packages Python initialises on the way are not edges.
Three kinds: *runtime* (run when A is imported: the module body, including ``if`` / ``try``
and class bodies), *type-only* (under ``if TYPE_CHECKING:``) and *local* (inside a function
body; a cycle that only these close was dodged at import time, the modules still lean on
each other).

The package's layers (:data:`LAYERS`, lowest first) say which way an import may run: a
module imports its own layer or one below, never one above (:func:`upward_imports`, every
kind of edge counted: a function-local import is still a dependency).

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
           "type_only_cycles", "dodged_cycles", "LAYERS", "layer_of", "UpwardImport", "upward_imports",
           "all_cycles", "public_names", "name_collisions", "private_imports"]

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


def all_cycles(graph: ImportGraph) -> list[list[str]]:
    """Cycles over every kind of edge: runtime, ``TYPE_CHECKING`` and function-local."""
    return cycles(_merged(_merged(graph.runtime, graph.type_only), graph.local))


# ---- (b) the layers: which way an import may run -------------------------------------------

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Leaves: import nothing of the package. stage/model_io.py and stage/arguments.py are what
    # the split makes once and a step runs (the call's checks and outputs, a stage's arguments),
    # kept out of split/ so a step runs no code of it; split/ and the schedule both use them.
    ("leaves", ("pippy_split.zoo", "pippy_split.microbatch", "pippy_split.stage.model_io",
                "pippy_split.stage.arguments")),
    ("split", ("pippy_split.split",)),  # trace, partition, Pipe: knows no ranks
    ("stage", ("pippy_split.stage",)),  # one stage's compute, transports, groups
    ("schedule", ("pippy_split.schedule",)),  # orders, lowering, the runtime, schedule classes
    ("generate", ("pippy_split.generate",)),  # decoding on the training stages
    # What users put around a schedule: checkpoints, clipping, loss scaling, packing, planning,
    # FSDP2/TP by pattern, torch's pipelining names.
    ("tools", ("pippy_split.checkpoint", "pippy_split.clip", "pippy_split.grad_scaler", "pippy_split.packing")),
    ("plan", ("pippy_split.plan",)),
    ("over plan", ("pippy_split.parallelize", "pippy_split.compat")),
    ("public API", ("pippy_split",)),  # pippy_split/__init__.py: re-exports only
    ("job", ("pippy_split.training",)),  # the train job's parts, on the public API
    ("launch", ("pippy_split.train",)),
    ("commands", ("pippy_split.commands",)),
    ("cli", ("pippy_split.cli",)),
    ("outside", ("pippy_split.integrations", "pippy_split.testing")),  # other programs' entry points
)
"""The package's layers, lowest first: ``(name, module prefixes)``. A module belongs to the
layer of its longest matching prefix (``pippy_split`` itself matches its ``__init__`` only)."""


Layers = tuple[tuple[str, tuple[str, ...]], ...]


def layer_of(module: str, layers: Layers = LAYERS) -> int:
    """The index in ``layers`` of ``module``'s layer (``KeyError`` if none holds it)."""
    best, found = -1, None
    root = layers[0][1][0].partition(".")[0] if layers and layers[0][1] else ""
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            hit = module == prefix or (prefix != root and module.startswith(prefix + "."))
            if hit and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise KeyError(f"{module} is in no layer of LAYERS")
    return found


@dataclass(frozen=True)
class UpwardImport:
    """An import from a module to one in a higher layer."""

    source: str
    target: str
    kind: str  # "runtime", "type-only" or "local"
    layers: tuple[str, str]  # the source's layer and the target's

    @property
    def pair(self) -> str:
        """``"split.pipe -> generate.local"``: the two modules, without the package's name."""
        return " -> ".join(n.partition(".")[2] or n for n in (self.source, self.target))

    def __str__(self) -> str:
        return f"{self.pair} ({self.kind}; layer {self.layers[0]} -> {self.layers[1]})"


def upward_imports(graph: ImportGraph, layers: Layers = LAYERS) -> list[UpwardImport]:
    """Every import, of any kind, that runs from a layer to a higher one."""
    out = []
    for kind, edges in (("runtime", graph.runtime), ("type-only", graph.type_only), ("local", graph.local)):
        for source, targets in edges.items():
            for target in targets:
                low, high = layer_of(source, layers), layer_of(target, layers)
                if high > low:
                    out.append(UpwardImport(source, target, kind, (layers[low][0], layers[high][0])))
    return sorted(out, key=lambda u: (u.source, u.target, u.kind))


# ---- (c) public names -------------------------------------------------------------------------

COLLISIONS_EXEMPT = ("pippy_split.compat",)
"""Packages whose names mirror another library's on purpose (compat: torch's pipelining names)."""

MODULE_PROTOCOLS = {
    "pippy_split.schedule.orders": frozenset({"compute_order", "PLACEMENT", "STAGES_PER_RANK", "MIN_STAGES_PER_RANK",
                                              "SPLIT_BACKWARD", "PAPER"}),
}
"""Names every module of a package states on purpose, read as one interface (each schedule
family module: its order generator and its needs as data, read by ``schedule/orders/__init__``)."""


def _defined_names(body: list[ast.stmt]) -> Iterator[str]:
    """Names a module body defines (classes, functions, assigned names), not the ones it imports."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            yield from (t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            yield from _defined_names(node.body)
            yield from _defined_names(node.orelse)


def public_names(mods: dict[str, Module]) -> dict[str, list[str]]:
    """``{name: [modules defining it]}`` for every public name (no leading ``_``) a module of
    a public module path defines (a family's :data:`MODULE_PROTOCOLS` names left out)."""
    out: dict[str, list[str]] = defaultdict(list)
    for mod in mods.values():
        if any(part.startswith("_") and part != "__init__" for part in mod.name.split(".")):
            continue
        protocol = MODULE_PROTOCOLS.get(mod.package, frozenset()) if not mod.is_package else frozenset()
        for name in sorted(set(_defined_names(mod.tree.body)) - protocol):
            if not name.startswith("_"):
                out[name].append(mod.name)
    return out


def name_collisions(mods: dict[str, Module], exempt: tuple[str, ...] = COLLISIONS_EXEMPT) -> dict[str, list[str]]:
    """Public names defined by more than one module (modules under ``exempt`` left out)."""
    names = public_names({n: m for n, m in mods.items() if not n.startswith(exempt)})
    return {name: where for name, where in sorted(names.items()) if len(where) > 1}


def private_imports(mods: dict[str, Module]) -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` for each private name (``_x``) a module imports from a
    module of another package (a layer reading another's private name), any kind of import."""
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for target in _targets(node, mod, mods) - {mod.name}:
                if mods[target].package == mod.package:
                    continue
                out += [(mod.name, target, a.name) for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__") and f"{target}.{a.name}" not in mods]
    return sorted(set(out))
