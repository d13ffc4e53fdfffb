"""The house figures of issue 24, for the current tree: imports, sizes, `Any` at seams, the step path.

Run with ``python -m benchmarks.house_figures [--out benchmarks/results/house_figures_X.txt]``
(about ten seconds: the static figures read every module's AST; the step path runs two gloo
ranks). It prints, for the package ``pippy_split``:

(a) **Import cycles among module-level imports** (the graph of :mod:`.import_graph`):
    every elementary cycle of the runtime edges, then those that also need a type-only
    edge (``if TYPE_CHECKING:``, a type that lives above its users), then those that also
    need a function-local import (a cycle dodged at import time); **imports that run up the
    layers** (:data:`.import_graph.LAYERS`, every kind of import counted); **public names
    defined twice** (:func:`.import_graph.name_collisions`); private names imported from
    another package.
(b) **Function-local imports**: ``import`` statements inside a function body, per package
    (a package is a directory: ``pippy_split.schedule.orders`` apart from
    ``pippy_split.schedule``) and in total.
(c) **`Any` at seams**: parameters (``*args`` / ``**kwargs`` and ``self`` / ``cls`` left
    out) annotated ``Any``, ``Any | None`` or ``Optional[Any]``: all of them per package,
    and the *seam* ones, whose name is one of :data:`SEAM_NAMES` (what one layer hands the
    next: a group, a mesh, a pipe, a stage, a device, options); also parameters annotated
    ``argparse.Namespace``.
(d) **Sizes**: files per package; files over 400 lines; functions over 60 lines (a
    function's lines run from ``def`` to its last line, nested functions included).
(e) **The step path**: distinct pippy_split functions (``(file, qualified name)``; lambdas
    and comprehensions apart) called during one ``sched.step(x, target=y)`` of
    ``Schedule1F1B`` with the tiny GPT split in 2 stages on 2 gloo ranks, 4 microbatches,
    recorded with ``sys.setprofile`` in each rank: the first step (with its one-off work)
    and the second (steady state), per rank and over both. The model's own ``forward``
    (``pippy_split/zoo/``) is the user's code, not counted.

The import walker lives in :mod:`benchmarks.import_graph`, which ``tests/test_import_cycles.py``
runs too.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from .import_graph import (
    LAYERS,
    PACKAGE_DIR,
    Module,
    cycles,
    dodged_cycles,
    function_level_imports,
    import_graph,
    modules,
    name_collisions,
    private_imports,
    type_only_cycles,
    upward_imports,
)

ROOT = PACKAGE_DIR.parent
SEAM_NAMES = frozenset({"group", "mesh", "pipe", "stage", "stages", "sched", "schedule", "device", "options", "config", "cfg",
                        "args"})
BIG_FILE, BIG_FUNCTION = 400, 60
STEP_N_MB = 4


# ---- (b) - (d) counts from the AST --------------------------------------------------------


def _short(name: str) -> str:
    return name.removeprefix("pippy_split").lstrip(".") or "(pippy_split)"


def function_local_imports(mods: dict[str, Module]) -> Counter[str]:
    """Import statements inside function bodies, per package."""
    return Counter({name: n for name, n in Counter(
        m.package for m in mods.values() for _ in function_level_imports(m.tree)).items()})


def _is_any(ann: ast.expr | None) -> bool:
    if ann is None:
        return False
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        return ann.value.replace(" ", "") in ("Any", "Any|None", "Optional[Any]")
    if isinstance(ann, ast.BinOp):  # Any | None
        return _is_any(ann.left) or _is_any(ann.right)
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return _is_any(ann.slice)
    return (isinstance(ann, ast.Name) and ann.id == "Any") or (isinstance(ann, ast.Attribute) and ann.attr == "Any")


def _is_namespace(ann: ast.expr | None) -> bool:
    return ann is not None and "Namespace" in ast.unparse(ann)


def any_params(mods: dict[str, Module]) -> tuple[Counter[str], Counter[str], Counter[str], Counter[str]]:
    """Per package: params annotated Any, those with a seam name, seam names themselves, Namespace params."""
    all_any: Counter[str] = Counter()
    seam: Counter[str] = Counter()
    seam_names: Counter[str] = Counter()
    namespace: Counter[str] = Counter()
    for mod in mods.values():
        for fn in ast.walk(mod.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = fn.args
            for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if p.arg in ("self", "cls"):
                    continue
                namespace[mod.package] += _is_namespace(p.annotation)
                if _is_any(p.annotation):
                    all_any[mod.package] += 1
                    if p.arg in SEAM_NAMES:
                        seam[mod.package] += 1
                        seam_names[p.arg] += 1
    return all_any, seam, seam_names, namespace


def big_functions(mods: dict[str, Module], code_only: bool = False) -> list[tuple[int, str]]:
    """``(lines, "path:line qualname")`` of every function over :data:`BIG_FUNCTION` lines;
    ``code_only``: not counting the function's own docstring."""
    out = []
    for mod in mods.values():
        for qual, fn in _functions(mod.tree.body, ""):
            n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            if code_only:
                n -= _docstring_lines(fn)
            if n > BIG_FUNCTION:
                out.append((n, f"{mod.path.relative_to(ROOT)}:{fn.lineno} {qual}"))
    return sorted(out, reverse=True)


def _docstring_lines(fn: Any) -> int:
    first = fn.body[0] if fn.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return (first.end_lineno or first.lineno) - first.lineno + 1
    return 0


def _functions(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AST]]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node.body, f"{prefix}{node.name}.")


# ---- (e) the step path ---------------------------------------------------------------------


def _profiled(call: Any) -> set[tuple[str, str]]:
    """``(file under pippy_split/, qualified name)`` of every function ``call()`` enters."""
    import threading

    seen: set[tuple[str, str]] = set()
    root = str(PACKAGE_DIR) + "/"

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            code = frame.f_code
            seen.add((code.co_filename.removeprefix(root), code.co_qualname))

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


def _step_path_rank(rank: int, world: int, n_mb: int) -> dict[str, list[tuple[str, str]]]:
    """Inside one rank: build the tiny GPT's 1F1B schedule, profile a first and a second step."""
    import pippy_split as ps
    from pippy_split import zoo

    entry = zoo.get("tiny_gpt", num_stages=2)
    mb_args, mb_kwargs = ps.split_args_kwargs(entry.args, entry.kwargs, n_mb)[0]
    pipe = ps.pipeline(entry.model, entry.split_spec, tuple(mb_args), dict(mb_kwargs))
    sched = ps.build_schedule(pipe, "1F1B", n_mb, loss_fn=entry.loss_fn)
    assert type(sched).__name__ == "Schedule1F1B"
    x, y = entry.args[0], entry.target

    def step() -> None:
        sched.step(x, target=y)

    first = _profiled(step)
    steady = _profiled(step)
    return {"first": sorted(first), "steady": sorted(steady)}


def step_path() -> dict[str, Any]:
    """Per step (first, steady): functions per rank and over both ranks, and their files."""
    from pippy_split.testing import run_ranks

    results = run_ranks(_step_path_rank, 2, STEP_N_MB, timeout=300)
    out: dict[str, Any] = {}
    for which in ("first", "steady"):
        per_rank = [{(f, q) for f, q in r[which]} for r in results]
        union = set().union(*per_rank)
        union = {f for f in union if not f[0].startswith("zoo/")}  # the user's model, not the library
        named = {f for f in union if not f[1].rpartition(".")[2].startswith("<")}
        out[which] = {"per_rank": [len({f for f in s if f in named}) for s in per_rank], "functions": len(named),
                      "lambdas_comprehensions": len(union - named), "files": sorted({f for f, _ in named}),
                      "names": sorted(named)}
    return out


# ---- report --------------------------------------------------------------------------------


def _table(counts: dict[str, int], packages: list[str]) -> list[str]:
    rows = [f"  {_short(p):<28} {counts.get(p, 0):>5}" for p in packages if counts.get(p, 0)]
    return rows + [f"  {'total':<28} {sum(counts.values()):>5}"]


def static_report(mods: dict[str, Module]) -> list[str]:
    packages = sorted({m.package for m in mods.values()})
    graph = import_graph(mods)
    lines = ["(a) import cycles among module-level imports"]
    runtime = cycles(graph.runtime)
    lines.append(f"  runtime cycles: {len(runtime)}")
    lines += ["    " + " -> ".join(map(_short, c + c[:1])) for c in runtime]
    typed = type_only_cycles(graph)
    lines.append(f"  cycles closed only by a TYPE_CHECKING import: {len(typed)}")
    lines += ["    " + " -> ".join(map(_short, c + c[:1])) for c in typed]
    dodged = dodged_cycles(graph)
    lines.append(f"  cycles closed only by a function-local import (dodged at import time): {len(dodged)}")
    lines += ["    " + " -> ".join(map(_short, c + c[:1])) for c in dodged]
    upward = upward_imports(graph)
    lines.append(f"  imports that run up the layers (any kind): {len(upward)} "
                 f"({len({u.pair for u in upward})} module pairs)")
    lines.append("    layers, lowest first: " + " < ".join(name for name, _ in LAYERS))
    lines += [f"    {u}" for u in upward]
    collisions = name_collisions(mods)
    lines.append(f"  public names defined in more than one module (compat apart): {len(collisions)}")
    lines += [f"    {name}: {', '.join(map(_short, where))}" for name, where in collisions.items()]
    private = private_imports(mods)
    lines.append(f"  private names imported from another package: {len(private)}")
    lines += [f"    {_short(a)} imports {_short(b)}.{name}" for a, b, name in private]
    lines += ["", "(b) function-local imports per package", *_table(function_local_imports(mods), packages)]
    all_any, seam, seam_names, namespace = any_params(mods)
    lines += ["", "(c) parameters annotated Any (no *args/**kwargs/self/cls), per package", *_table(all_any, packages)]
    lines += [f"  at seams (named {', '.join(sorted(SEAM_NAMES))}):", *_table(seam, packages)]
    lines.append("  by name: " + ", ".join(f"{n} {c}" for n, c in seam_names.most_common()))
    lines.append(f"  parameters annotated argparse.Namespace: {sum(namespace.values())}")
    files = Counter(m.package for m in mods.values())
    lines += ["", f"(d) files per package ({len(mods)} modules)", *_table(files, packages)]
    big = sorted(((m.lines, str(m.path.relative_to(ROOT))) for m in mods.values() if m.lines > BIG_FILE), reverse=True)
    lines.append(f"  files over {BIG_FILE} lines: {len(big)}")
    lines += [f"    {n:>5} {p}" for n, p in big]
    funcs = big_functions(mods)
    lines.append(f"  functions over {BIG_FUNCTION} lines: {len(funcs)}")
    lines += [f"    {n:>5} {where}" for n, where in funcs]
    code = big_functions(mods, code_only=True)
    lines.append(f"  functions over {BIG_FUNCTION} lines without their docstring: {len(code)}")
    lines += [f"    {n:>5} {where}" for n, where in code]
    return lines


def step_report(path: dict[str, Any]) -> list[str]:
    lines = [f"(e) one sched.step(x, target=y): Schedule1F1B, tiny GPT in 2 stages, 2 gloo ranks, {STEP_N_MB} mb"]
    for which in ("first", "steady"):
        p = path[which]
        lines.append(f"  {which} step: {p['functions']} functions in {len(p['files'])} files (rank 0: "
                     f"{p['per_rank'][0]}, rank 1: {p['per_rank'][1]}; plus {p['lambdas_comprehensions']} "
                     "lambdas/comprehensions)")
    lines.append("  files on the steady step: " + ", ".join(path["steady"]["files"]))
    lines.append("  functions on the steady step:")
    lines += [f"    {f}:{q}" for f, q in path["steady"]["names"]]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument("--no-step", action="store_true", help="skip (e), which starts two ranks")
    opts = parser.parse_args(argv)
    from benchmarks.common import git_state

    commit, dirty = git_state(ROOT)
    lines = [f"house figures of pippy_split at {commit}{' (+ uncommitted changes)' if dirty else ''}",
             "command: python -m benchmarks.house_figures", ""]
    lines += static_report(modules())
    if not opts.no_step:
        lines += ["", *step_report(step_path())]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if opts.out is not None:
        opts.out.write_text(text)


if __name__ == "__main__":
    main()
