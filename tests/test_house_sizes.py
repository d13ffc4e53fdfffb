"""No file of pippy_split over 400 lines and no function over 60 (docstrings included): the
sizes ``python -m benchmarks.house_figures`` reports, held here so that they do not slip again
between two counts (issue 42: two functions had grown past 60 in one session). Pure tier."""

from __future__ import annotations

from benchmarks.house_figures import BIG_FILE, BIG_FUNCTION, ROOT, big_functions
from benchmarks.import_graph import modules


def test_no_file_over_400_lines() -> None:
    big = sorted(str(m.path.relative_to(ROOT)) for m in modules().values() if m.lines > BIG_FILE)
    assert not big, f"over {BIG_FILE} lines: {big}: give an idea its own module"


def test_no_function_over_60_lines() -> None:
    big = big_functions(modules())
    assert not big, f"over {BIG_FUNCTION} lines: {big}: give a step its own function"
