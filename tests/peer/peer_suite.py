"""Run torch.distributed.pipelining's own tests (the peer's) through ``pippy_split.compat``.

PyTorch's test files are PyTorch's code, so this repository does not keep copies: you name a
folder that holds them (a PyTorch checkout's ``test/distributed/pipelining``, at the release's
tag), and they are copied to a temporary folder with their imports switched, then run with
pytest on the installed torch. What runs and what is excused is data: ``peer_tests_2_15.json``
beside this file lists the public-API tests (by class and method) and, for each one that fails
here for a reason that does not change, that reason in one line.

Switching imports (:func:`switch_imports`): each name a ``from torch.distributed.pipelining[.X]
import ...`` brings in comes from ``pippy_split.compat[.X]`` where compat has it, else from the
peer (its private helpers); a name the installed torch lacks (a newer release's private module
or test-harness helper) becomes a stand-in that raises when used, so the file still imports and
only the tests that use it fail. The peer's tests need ``expecttest`` (PyTorch's test harness).

    python -m tests.peer.peer_suite ~/pytorch/test/distributed/pipelining
    # 2.15.0 public-API tests: 29 selected, 23 passed, 6 failed (6 excused, 0 not), 0 skipped
    python -m tests.peer.peer_suite --peer ~/pytorch/test/distributed/pipelining   # the installed peer itself
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("peer_tests_2_15.json")
PEER = "torch.distributed.pipelining"
COMPAT = "pippy_split.compat"
COMPAT_MODULES = {"", ".schedules", ".stage", ".microbatch"}  # the peer's public modules
ENV = "PIPPY_PEER_TESTS"

_STAND_IN = '''"""Stand-ins for names the installed torch lacks (written by tests/peer/peer_suite.py)."""


class Missing:
    def __init__(self, what):
        self._what = what

    def __getattr__(self, name):
        if not name[:1].isupper():  # members (an enum's GENERIC) stand in too; hasattr probes say no
            raise AttributeError(f"{self._what}.{name}: {self._what} is not in the installed torch")
        return Missing(f"{self._what}.{name}")

    def __call__(self, *args, **kwargs):
        import torch

        raise ImportError(f"{self._what} is not in the installed torch {torch.__version__}")

    def __mro_entries__(self, bases):
        return ()
'''


def load() -> dict:
    """The selection and excuses for the 2.15.0 public-API tests."""
    return json.loads(DATA.read_text())


def _has(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _source_of(module: str, name: str, compat: bool = True) -> str | None:
    """Where ``name`` of ``module`` (a module the peer's file imports from) comes from here."""
    if compat and (module == PEER or module.startswith(PEER + ".")):
        suffix = module[len(PEER):]
        if suffix in COMPAT_MODULES and _has(COMPAT + suffix, name):
            return COMPAT + suffix
    return module if _has(module, name) else None


def switch_imports(source: str, compat: bool = True) -> str:
    """``source`` with the peer's imports taken from compat, and missing torch names stood in for
    (with ``compat=False`` only the stand-ins: the installed peer runs its newer tests itself).

    >>> print(switch_imports("from torch.distributed.pipelining import pipeline, _NoSuchName"), end="")
    from pippy_split.compat import pipeline
    from _peer_missing import Missing as _Missing
    _NoSuchName = _Missing('torch.distributed.pipelining._NoSuchName')
    """
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("torch"):
            new = []
            for alias in node.names:
                bound = alias.asname or alias.name
                origin = _source_of(node.module, alias.name, compat)
                if origin is None:
                    new.append(_missing(bound, f"{node.module}.{alias.name}"))
                else:
                    new.append(f"from {origin} import {alias.name}" + (f" as {bound}" if bound != alias.name else ""))
            edits.append((node.lineno, node.end_lineno or node.lineno, new))
        elif isinstance(node, ast.Import) and len(node.names) == 1 and node.names[0].asname:
            alias = node.names[0]
            if alias.name.startswith("torch") and not _importable(alias.name):
                edits.append((node.lineno, node.end_lineno or node.lineno, [_missing(alias.asname, alias.name)]))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [ln + "\n" for ln in new]
    return "".join(lines)


def _missing(bound: str, what: str) -> str:
    return f"from _peer_missing import Missing as _Missing\n{bound} = _Missing({what!r})"


def prepare(src: Path, dst: Path, files: list[str], compat: bool = True) -> list[str]:
    """Copy ``files`` (those present) from ``src`` to ``dst`` with imports switched; the copied names."""
    (dst / "_peer_missing.py").write_text(_STAND_IN)
    copied = []
    for name in files:
        if (src / name).is_file():
            (dst / name).write_text(switch_imports((src / name).read_text(), compat))
            copied.append(name)
    return copied


@dataclass
class Outcome:
    """What the selected tests did: test id (``file::Class::test``) -> passed / failed / skipped."""

    results: dict[str, str]
    messages: dict[str, str] = field(default_factory=dict)

    def summary(self, excused: dict[str, str]) -> dict[str, list[str]]:
        """Tests by outcome, the failures split into excused and not, and the excused that passed."""
        out: dict[str, list[str]] = {"passed": [], "excused": [], "unexcused": [], "skipped": [], "excused_but_passed": []}
        for test, result in sorted(self.results.items()):
            reason = excuse_for(test, excused)
            if result == "failed":
                out["excused" if reason else "unexcused"].append(test)
            elif result == "passed":
                out["passed"].append(test)
                if reason:
                    out["excused_but_passed"].append(test)
            else:
                out["skipped"].append(test)
        return out


def excuse_for(test: str, excused: dict[str, str]) -> str | None:
    """The reason a test is excused: the longest key that is a prefix of its ``Class::test`` part."""
    tail = test.split("::", 1)[1]
    keys = [k for k in excused if tail.startswith(k)]
    return excused[max(keys, key=len)] if keys else None


def run(src: Path, data: dict | None = None, python: str = sys.executable, timeout: int = 900,
        compat: bool = True) -> Outcome:
    """Run the selected public-API tests of the peer's files in ``src`` through compat (or, with
    ``compat=False``, against the installed peer itself, for comparison)."""
    data = data or load()
    with tempfile.TemporaryDirectory(prefix="peer_tests_") as tmp:
        work = Path(tmp)
        copied = prepare(src, work, data["files"] + data["helpers"], compat)
        tests = [f for f in data["files"] if f in copied]
        methods = sorted({t.split("::")[1] for t in data["tests"]})
        report = work / "report.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(work)]))
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(work),
               f"--junitxml={report}", "-k", " or ".join(methods), *tests]
        subprocess.run(cmd, cwd=work, env=env, timeout=timeout, capture_output=True, text=True)
        return _read_report(report, data["tests"])


def _read_report(report: Path, selected: list[str]) -> Outcome:
    outcome = Outcome({})
    for case in ET.parse(report).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").rpartition(".")
        test = f"{module}.py::{cls}::{case.get('name')}"
        tail = test.split("::", 1)[1]
        if not any(tail.startswith(s) for s in selected):
            continue
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            outcome.results[test] = "failed"
            outcome.messages[test] = (bad.get("message") or "").strip().splitlines()[0][:200] if bad.get("message") else ""
        elif case.find("skipped") is not None:
            outcome.results[test] = "skipped"
        else:
            outcome.results[test] = "passed"
    return outcome


def main(argv: list[str]) -> int:
    peer = "--peer" in argv  # the installed peer itself, not compat: what the excuses compare with
    args = [a for a in argv[1:] if a != "--peer"]
    src = Path(args[0] if args else os.environ.get(ENV, ""))
    if not src.is_dir():
        print(f"usage: python -m tests.peer.peer_suite [--peer] <pytorch>/test/distributed/pipelining (or set {ENV})")
        return 2
    data = load()
    outcome = run(src, data, compat=not peer)
    summary = outcome.summary(data["excused"])
    for test in summary["unexcused"]:
        print(f"FAILED (not excused) {test}: {outcome.messages.get(test, '')}")
    for test in summary["excused"]:
        print(f"failed (excused)     {test}: {excuse_for(test, data['excused'])}")
    for test in summary["excused_but_passed"] if not peer else []:  # the excuses are compat's
        print(f"PASSED but excused   {test}: remove its excuse")
    n = len(outcome.results)
    print(f"{data['release']} public-API tests: {n} selected, {len(summary['passed'])} passed, "
          f"{len(summary['excused']) + len(summary['unexcused'])} failed ({len(summary['excused'])} excused, "
          f"{len(summary['unexcused'])} not), {len(summary['skipped'])} skipped")
    return 1 if summary["unexcused"] or (summary["excused_but_passed"] and not peer) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
