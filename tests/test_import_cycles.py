"""pippy_split's modules import one way: no cycle and no import that runs back up the layers,
every import counted (module-level, ``TYPE_CHECKING`` and function-local); and every public
name is defined once.

The walker is :mod:`benchmarks.import_graph` (the one ``python -m benchmarks.house_figures``
reports with): it reads every module's AST, resolves relative imports, and keeps
``TYPE_CHECKING`` and function-local imports apart; the layers are its ``LAYERS`` (the flow
of ARCHITECTURE.md, lowest first). Pure tier.

Run: python -m pytest tests/test_import_cycles.py -q -p no:cacheprovider
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.import_graph import (
    LAYERS,
    all_cycles,
    cycles,
    dodged_cycles,
    import_graph,
    layer_of,
    modules,
    name_collisions,
    private_imports,
    type_only_cycles,
    upward_imports,
)

# The allow-lists below are the lead's (issue 39/42: being removed); house_figures prints what
# is left of each. Drop an entry when it goes: nothing new may join them.

BEING_REMOVED_UPWARD: set[str] = set()  # generate's: gone (Pipe and PipelineSchedule reach it through split/hand_over)
BEING_REMOVED_CYCLE_EDGES: set[str] = set()  # generate.program <-> generate.phased: gone (generate/programs.py)
BUILD_STAGE_HAND_OVER: set[str] = set()  # gone: the stage layer hands Pipe.build_stage its builder (split/hand_over)
BEING_REMOVED_COLLISIONS: dict[str, list[str]] = {}  # Channel, Link, pack, Plan, StepInputs: renamed


def _short(name: str) -> str:
    return name.removeprefix("pippy_split.")


def _short_cycle(cycle: list[str]) -> list[str]:
    return list(map(_short, cycle))


def _edges(cycle: list[str]) -> set[str]:
    """``"a -> b"`` for each import of a cycle."""
    return {f"{a} -> {b}" for a, b in zip(cycle, cycle[1:] + cycle[:1])}


def _names(found: list[list[str]]) -> list[str]:
    return [" -> ".join(map(_short, c + c[:1])) for c in found]


def test_no_import_runs_up_the_layers() -> None:
    """A module imports its own layer or a lower one, whatever the kind of import."""
    found = {u.pair for u in upward_imports(import_graph())}
    assert sorted(found - BEING_REMOVED_UPWARD - BUILD_STAGE_HAND_OVER) == []


def test_no_cycle_counting_every_import() -> None:
    """No cycle, function-local and ``TYPE_CHECKING`` imports counted (one dodged at import
    time still ties the modules together)."""
    found = [_short_cycle(c) for c in all_cycles(import_graph())]
    assert [" -> ".join(c + c[:1]) for c in found if not _edges(c) & BEING_REMOVED_CYCLE_EDGES] == []


def test_no_private_name_is_imported_from_another_package() -> None:
    """Layers ask each other through public names."""
    assert private_imports(modules()) == []


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_public_names_are_unique() -> None:
    """Every public name is defined by one module (compat's mirrors of torch's names and the
    schedule families' shared interface apart)."""
    found = {name: list(map(_short, where)) for name, where in name_collisions(modules()).items()}
    assert {n: w for n, w in found.items() if BEING_REMOVED_COLLISIONS.get(n) != w} == {}


def test_no_cycle_among_module_level_imports() -> None:
    assert _names(cycles(import_graph().runtime)) == []


def test_no_cycle_closed_by_a_type_checking_import() -> None:
    """A type imported for annotations only still says which module sits above which."""
    assert _names(type_only_cycles(import_graph())) == []


def test_schedule_needs_no_function_local_import_to_dodge_a_cycle() -> None:
    """Inside ``schedule/`` a function-local import is there for a heavy optional import
    (``rich``, for pictures), never to break a cycle."""
    inside = [c for c in dodged_cycles(import_graph()) if all(m.startswith("pippy_split.schedule") for m in c)]
    assert _names(inside) == []


def test_the_walker_sees_each_kind_of_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "from . import b\nA = 1\n",
        "b.py": "try:\n    from .a import A\nexcept ImportError:\n    pass\n",  # runtime: a <-> b
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.d import D\n",
        "sub/__init__.py": "",
        "sub/d.py": "from ..c import TYPE_CHECKING\nD = 1\n",  # type-only: c <-> sub.d
        "e.py": "import pkg.f\n",
        "f.py": "def g():\n    from .e import x\n",  # function-local: e <-> f
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(modules(pkg))
    assert _names(cycles(graph.runtime)) == ["pkg.a -> pkg.b -> pkg.a"]
    assert _names(type_only_cycles(graph)) == ["pkg.c -> pkg.sub.d -> pkg.c"]
    assert _names(dodged_cycles(graph)) == ["pkg.e -> pkg.f -> pkg.e"]
    assert len(all_cycles(graph)) == 3


def test_the_walker_sees_an_import_up_the_layers(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    files = {
        "__init__.py": "from .high import H\n",  # the top layer: down, allowed
        "high.py": "from .low import L\nH = 1\n",
        "low/__init__.py": "L = 1\n",
        "low/leaf.py": "def f():\n    from ..high import H\n",  # local, and up
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    layers = (("low", ("pkg.low",)), ("high", ("pkg.high",)), ("top", ("pkg",)))
    found = upward_imports(import_graph(modules(pkg)), layers)
    assert [str(u) for u in found] == ["low.leaf -> high (local; layer low -> high)"]
    assert LAYERS[0][0] == "leaves"
    (pkg / "high.py").write_text("from .low import _hidden\nH = 1\n")
    assert private_imports(modules(pkg)) == [("pkg.high", "pkg.low", "_hidden")]
