"""``python -m tests.streams`` (the README's test command): the two pytest processes together
run every collected test exactly once, whole files each, and the order reads pytest's
durations report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.streams import ENV, file_seconds

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_streams_together_run_every_test_once_whole_files_each():
    paths = ("tests/schedule/test_lower.py", "tests/schedule/test_render.py", "tests/test_microbatch.py",
             "tests/test_packing.py", "tests/split/test_edge_names.py")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    whole = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *paths],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    ids = sorted(ln for ln in whole.splitlines() if "::" in ln)
    run = subprocess.run([sys.executable, "-m", "tests.streams", "-p", "no:cacheprovider", "-vv", *paths],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
    streams = run.stdout.split("======== stream ")[1:]
    assert len(streams) == 2
    ran = [sorted(m.group(1) for m in re.finditer(r"^(tests/\S+::\S+) (?:PASSED|SKIPPED|XFAIL)", s, re.M))
           for s in streams]
    assert sorted(ran[0] + ran[1]) == ids
    files = [{t.split("::")[0] for t in r} for r in ran]
    assert not files[0] & files[1], "a file's tests (and its module fixtures) stay in one process"
    assert f"{len(ids)} passed" in run.stdout.splitlines()[-1] or "skipped" in run.stdout.splitlines()[-1]


def test_file_seconds_sums_setup_call_and_teardown_per_file():
    log = """============================= slowest durations =============================
12.50s call     tests/a.py::test_one[x]
2.00s setup    tests/a.py::test_one[x]
1.25s call     tests/b/c.py::test_two
(3 durations < 0.005s hidden.)
"""
    assert file_seconds(log) == {"tests/a.py": 14.5, "tests/b/c.py": 1.25}
