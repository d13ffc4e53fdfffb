"""The docstring examples of every pippy_split module run as doctests.

Examples that only illustrate (they use a ``pipe``, ``sched`` or model the docstring does
not build) carry ``# doctest: +SKIP``; every other example runs here. Pure tier.

Run: python -m pytest tests/test_doctests.py -q -p no:cacheprovider
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import pippy_split

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    names = [pippy_split.__name__]
    for info in pkgutil.walk_packages(pippy_split.__path__, prefix=pippy_split.__name__ + "."):
        names.append(info.name)
    return sorted(names)


def _run(name: str) -> tuple[doctest.DocTestRunner, str]:
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):  # globals: the module's own
        runner.run(test, out=report.append)
    return runner, "".join(report)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", _modules())
def test_doctests(name: str) -> None:
    runner, report = _run(name)
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} examples failed in {name}:\n{report}"


@pytest.mark.timeout(60)
def test_examples_run_at_all() -> None:
    """The finder sees the package's examples (a broken finder would pass every module)."""
    assert sum(_run(name)[0].tries for name in _modules()) >= 60
