"""When a rank of `pippy-split train` fails under the elastic launcher, one line names the rank and the
root cause (a bug in a rank: that rank's traceback above it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pippy_split.train import failure_line


def _failure(tmp_path, rank: int, exitcode: int, message: dict | None = None):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = str(tmp_path / f"error_{rank}.json")
    if message is not None:
        with open(error_file, "w") as f:
            json.dump({"message": message}, f)
    return ChildFailedError("worker", {rank: ProcessFailure(local_rank=rank, pid=4242, exitcode=exitcode,
                                                            error_file=error_file)})


def test_failure_line_names_rank_and_cause(tmp_path):
    raised = {"message": "RuntimeError: Numpy is not available\nsecond line",
              "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}
    assert failure_line(_failure(tmp_path, 1, 1, raised)) == \
        "pippy-split train: rank 1 failed: RuntimeError: Numpy is not available ..."
    assert failure_line(_failure(tmp_path, 0, -9)) == \
        "pippy-split train: rank 0 failed: Signal 9 (SIGKILL) received by PID 4242"
    assert failure_line(_failure(tmp_path, 3, 2)) == \
        "pippy-split train: rank 3 failed: exit status 2 (its own output above says why)"


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_an_error_found_in_a_rank_is_one_line(tmp_path):
    """No traceback frames and no launcher dump: the line names the rank and the cause (the split is only
    known to be wrong once a rank has built the model)."""
    env = dict(os.environ, COLUMNS="160")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "pippy_split.cli", "train", "--steps", "1", "--samples", "1",
                        "--split", "blocks.1,blocks.2,blocks.9", "--checkpoint", str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=150)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert re.fullmatch(r"pippy-split train: rank \d failed: SplitError: split_spec names 'blocks.9', which is not "
                        r"a submodule of TinyGPT.*", lines[0]), r.stderr
    assert not (tmp_path / "run").exists()  # nothing written: no empty run directory left behind


def test_a_bug_in_a_rank_shows_that_rank_s_traceback_and_the_line(tmp_path):
    from pippy_split.train import rank_traceback

    stack = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nKeyError: 3'
    bug = _failure(tmp_path, 0, 1, {"message": "KeyError: 3", "extraInfo": {"py_callstack": stack, "timestamp": "1700000000"}})
    assert rank_traceback(bug) == stack and failure_line(bug) == "pippy-split train: rank 0 failed: KeyError: 3"
    found = _failure(tmp_path, 1, 1, {"message": "JobError: --data x.txt: line 3 is not JSON",
                                      "extraInfo": {"py_callstack": stack, "timestamp": "1700000000"}})
    assert rank_traceback(found) == "" and \
        failure_line(found) == "pippy-split train: rank 1 failed: --data x.txt: line 3 is not JSON"
