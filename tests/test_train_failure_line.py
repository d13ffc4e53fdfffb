"""When a rank of `pippy-split train` fails under the elastic launcher, the last line
of the output names the rank and the root cause, below the launcher's own dump."""

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


@pytest.mark.timeout(180)
def test_failed_rank_is_named_on_the_last_line(tmp_path):
    (tmp_path / "a_file").write_text("x")
    env = dict(os.environ, COLUMNS="160")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "pippy_split.cli", "train", "--steps", "1", "--samples", "1",
                        "--checkpoint", str(tmp_path / "a_file" / "ckpt")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=150)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    # found before the first step: the run directory (metrics.jsonl) is made first
    assert re.fullmatch(r"pippy-split train: rank 0 failed: CheckpointError: cannot write the run directory "
                        r"\S+/a_file/ckpt: Not a directory \(\S+/a_file\)", last), r.stderr
