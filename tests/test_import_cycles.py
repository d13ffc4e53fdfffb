"""pippy_split's modules import one way: no cycle among their module-level imports.

The walker is :mod:`benchmarks.import_graph` (the one ``python -m benchmarks.house_figures``
reports with): it reads every module's AST, resolves relative imports, and keeps
``TYPE_CHECKING`` and function-local imports apart. Pure tier.

Run: python -m pytest tests/test_import_cycles.py -q -p no:cacheprovider
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.import_graph import cycles, dodged_cycles, import_graph, modules, type_only_cycles


def _names(found: list[list[str]]) -> list[str]:
    return [" -> ".join(c + c[:1]) for c in found]


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
