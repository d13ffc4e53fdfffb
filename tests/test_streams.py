"""``python -m tests.streams`` (the README's test command): the two pytest processes together
run every collected test exactly once, whole files each, and report each file's seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.streams import ENV

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
    assert f"{len(ids)} passed" in run.stdout.splitlines()[-1]
    slowest = next(ln for ln in run.stdout.splitlines() if ln.startswith("streams: the slowest test files"))
    assert all(p in slowest for p in paths)
