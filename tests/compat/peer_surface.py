"""The public surface of torch.distributed.pipelining (the peer), as plain data.

A surface is, for each public module of the peer (the package, ``.schedules``, ``.microbatch``,
``.stage``), its ``__all__`` and, for each name in it, its kind and signatures: a function's
parameters; a class's constructor, its public methods and properties (those the peer's own
package defines, not ``nn.Module``'s), an enum's members, a dataclass's fields. A parameter is
``[name, kind, default]`` with ``kind`` as :class:`inspect.Parameter` names it and ``default``
the source text of the default (``None`` when there is none). ``action_kinds`` lists the
peer's action IR (the values of its private ``_ComputationType``).

Two readers give the same data: :func:`read_installed` imports the installed peer and uses
:mod:`inspect`; :func:`read_source` parses a release's source with :mod:`ast` and imports
nothing, so a release whose wheel cannot be imported here (a CUDA build) is read from its
files. ``tests/compat/test_api.py`` checks that both agree on the installed torch.

``peer_surfaces.json`` beside this file holds the surfaces of 2.13.0, 2.14.1 and 2.15.0, each
read with :func:`read_source` from the release's wheel. To add a release::

    pip download --no-deps torch==X.Y.Z -d /tmp/whl
    unzip -q /tmp/whl/torch-*.whl 'torch/distributed/pipelining/*' -d /tmp/whl/src
    python -m tests.compat.peer_surface X.Y.Z /tmp/whl/src/torch/distributed/pipelining
"""

from __future__ import annotations

import ast
import enum
import inspect
import json
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("peer_surfaces.json")
MODULES = {"": "__init__.py", "schedules": "schedules.py", "microbatch": "microbatch.py", "stage": "stage.py"}
PACKAGE = "torch.distributed.pipelining"

Params = list[list[Any]]


def load() -> dict[str, dict]:
    """The recorded surfaces, by torch version (``"2.13.0"``, ...)."""
    return json.loads(DATA.read_text())


# ---- the installed peer, through inspect ---------------------------------------------------------


def read_installed() -> dict:
    """The installed torch's surface (imports ``torch.distributed.pipelining``)."""
    import importlib

    surface: dict[str, Any] = {"modules": {}}
    for short in MODULES:
        mod = importlib.import_module(f"{PACKAGE}.{short}" if short else PACKAGE)
        names = {n: _describe(getattr(mod, n)) for n in mod.__all__}
        surface["modules"][short] = {"all": list(mod.__all__), "names": names}
    sched = importlib.import_module(f"{PACKAGE}.schedules")
    surface["action_kinds"] = [m.value for m in sched._ComputationType]
    return surface


def _params(fn: Any) -> Params:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = None if p.default is p.empty else _default_text(p.default)
        out.append([p.name, p.kind.name, default])
    return out


def _default_text(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def _describe(obj: Any, package: str = PACKAGE) -> dict:
    """``obj``'s entry; a class's methods and properties are those defined in ``package``."""
    if not isinstance(obj, type):
        return {"kind": "function", "params": _params(obj)} if callable(obj) else {"kind": "other"}
    if issubclass(obj, enum.Enum):
        return {"kind": "enum", "members": list(obj.__members__)}
    entry: dict[str, Any] = {"kind": "class", "init": _params(obj), "methods": {}, "properties": []}
    if "__dataclass_fields__" in vars(obj):
        entry["fields"] = list(obj.__dataclass_fields__)
    for name in sorted(dir(obj)):
        if name.startswith("_"):
            continue
        owner = next((k for k in obj.__mro__ if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith(package):
            continue
        attr = vars(owner)[name]
        if isinstance(attr, property):
            entry["properties"].append(name)
        elif isinstance(attr, staticmethod):
            entry["methods"][name] = _params(attr.__func__)
        elif isinstance(attr, classmethod) or inspect.isfunction(attr):
            entry["methods"][name] = _params(getattr(attr, "__func__", attr))[1:]  # without self / cls
    return entry


# ---- a release's source, through ast ------------------------------------------------------------


class _Source:
    """The peer's package as parsed files; names resolved through ``from .x import y``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}

    def tree(self, file: str) -> ast.Module:
        if file not in self.trees:
            self.trees[file] = ast.parse((self.root / file).read_text())
        return self.trees[file]

    def find(self, file: str, name: str) -> tuple[str, ast.AST] | None:
        """The definition of ``name`` as seen from ``file``: (file it is in, node)."""
        for node in self.tree(file).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return file, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return file, node
        for node in self.tree(file).body:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = (node.module or "__init__").replace(".", "/") + ".py"
                        if (self.root / target).exists():
                            return self.find(target, alias.name)
        return None

    def all_of(self, file: str) -> list[str]:
        for node in self.tree(file).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
        raise ValueError(f"{file} has no __all__")


def read_source(root: str | Path) -> dict:
    """The surface of the peer whose package directory (``.../torch/distributed/pipelining``) is ``root``."""
    src = _Source(Path(root))
    surface: dict[str, Any] = {"modules": {}}
    for short, file in MODULES.items():
        names = {}
        for name in src.all_of(file):
            found = src.find(file, name)
            names[name] = {"kind": "other"} if found is None else _describe_node(src, *found)
        surface["modules"][short] = {"all": src.all_of(file), "names": names}
    found = src.find("schedules.py", "_ComputationType")
    assert found is not None and isinstance(found[1], ast.ClassDef)
    surface["action_kinds"] = [ast.literal_eval(n.value) for n in found[1].body
                               if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)]
    return surface


def _arg_list(args: ast.arguments, drop_first: bool) -> Params:
    out: Params = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (a, d) in enumerate(zip(positional, defaults)):
        if drop_first and i == 0:
            continue
        kind = "POSITIONAL_ONLY" if i < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([a.arg, kind, None if d is None else ast.unparse(d)])
    if args.vararg is not None:
        out.append([args.vararg.arg, "VAR_POSITIONAL", None])
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append([a.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)])
    if args.kwarg is not None:
        out.append([args.kwarg.arg, "VAR_KEYWORD", None])
    return out


def _decorators(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    return [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]


def _describe_node(src: _Source, file: str, node: ast.AST) -> dict:
    if isinstance(node, ast.FunctionDef):
        return {"kind": "function", "params": _arg_list(node.args, drop_first=False)}
    if not isinstance(node, ast.ClassDef):
        return {"kind": "other"}
    chain = _class_chain(src, file, node)
    if any(b in ("Enum", "enum.Enum") for _, c in chain for b in map(ast.unparse, c.bases)):
        return {"kind": "enum", "members": [t.id for n in node.body if isinstance(n, ast.Assign)
                                            for t in n.targets if isinstance(t, ast.Name)]}
    entry: dict[str, Any] = {"kind": "class", "init": [], "methods": {}, "properties": []}
    init = next((f for _, c in chain for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if "dataclass" in _decorators(node):
        entry["fields"] = [n.target.id for n in node.body
                           if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        entry["init"] = _dataclass_init(node)
    elif init is not None:
        entry["init"] = _arg_list(init.args, drop_first=True)
    seen: set[str] = set()
    for _, cls in chain:  # the class first, then its bases: the nearest definition wins
        for f in cls.body:
            if not isinstance(f, ast.FunctionDef) or f.name.startswith("_") or f.name in seen:
                continue
            seen.add(f.name)
            decorators = _decorators(f)
            if "property" in decorators or any(d.endswith(".setter") for d in decorators):
                entry["properties"].append(f.name)
            else:
                entry["methods"][f.name] = _arg_list(f.args, drop_first="staticmethod" not in decorators)
    entry["properties"].sort()
    entry["methods"] = dict(sorted(entry["methods"].items()))
    return entry


def _class_chain(src: _Source, file: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases defined in the peer's package, nearest first (depth-first, as a
    single-inheritance MRO is)."""
    out = [(file, node)]
    for base in node.bases:
        found = src.find(file, ast.unparse(base)) if isinstance(base, ast.Name) else None
        if found is not None and isinstance(found[1], ast.ClassDef):
            out += [c for c in _class_chain(src, found[0], found[1]) if c not in out]
    return out


def _dataclass_init(node: ast.ClassDef) -> Params:
    kw_only = any(isinstance(d, ast.Call) and any(k.arg == "kw_only" and ast.unparse(k.value) == "True"
                                                  for k in d.keywords) for d in node.decorator_list)
    out: Params = []
    for n in node.body:
        if not (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)):
            continue
        default = None
        if n.value is not None:
            call = n.value
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "field":
                default = next((ast.unparse(k.value) for k in call.keywords if k.arg == "default"), None)
            else:
                default = ast.unparse(call)
        out.append([n.target.id, "KEYWORD_ONLY" if kw_only else "POSITIONAL_OR_KEYWORD", default])
    return out


def main(argv: list[str]) -> None:
    version, root = argv
    data = load() if DATA.exists() else {}
    data[version] = read_source(root)
    DATA.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
