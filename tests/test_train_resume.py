"""`pippy-split train --resume` continues a run where it stopped: the step count (metrics.jsonl goes on), the
LR schedule and the data order, to --steps in all; it ends where one uninterrupted run ends. A run stopped by
SIGINT (Ctrl-C) or SIGTERM (a scheduler) stops every rank after the same step, saves, and says in one line how
to resume; resumed, it ends where the uninterrupted run ends. One uninterrupted run (``whole``) serves both."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from pippy_split.training.setup import load_model_file

from .test_cli import _cli, _ok

_STEPS = 16
_RUN = ("--steps", str(_STEPS), "--batch-size", "32", "--samples", "0", "--lr-schedule", "constant",
        "--warmup-steps", "3", "--log-every", "1", "--no-tensorboard")


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_weights(a, b) -> None:
    saved, resumed = (load_model_file(str(d)) for d in (a, b))
    assert resumed["meta"]["losses"] == pytest.approx(saved["meta"]["losses"], abs=1e-6)
    for k, v in saved["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][k], v, atol=1e-6, rtol=0, msg=k)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """One uninterrupted run of ``_STEPS`` steps."""
    where = tmp_path_factory.mktemp("whole")
    out = _ok(_cli("train", *_RUN, "--checkpoint", "whole", cwd=where))
    assert f"loss and tokens/s per step, charted: {os.path.join('whole', 'metrics.svg')}" in out, out
    assert out.rstrip().splitlines()[-1] == "next: pippy-split generate whole --prompt 07+45=", out  # what to run next
    assert (where / "whole" / "metrics.svg").read_text().count("<polyline") == 2
    return where / "whole"


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_resume_continues_steps_lr_and_data_to_the_total(whole, tmp_path, capsys, monkeypatch):
    from .test_train_errors import _one_line

    _ok(_cli("train", *_RUN, "--steps", "2", "--checkpoint", "halves", cwd=tmp_path))
    out = _ok(_cli("train", *_RUN, "--resume", "--checkpoint", "halves", cwd=tmp_path))
    assert f"resumed at step 2 of {_STEPS}" in out, out
    assert f"({_STEPS - 2} steps, " in out, out  # the steps this run made, not the run's total
    halves = _records(tmp_path / "halves")
    assert [r["step"] for r in halves] == list(range(1, _STEPS + 1))
    for a, b in zip(_records(whole), halves, strict=True):  # warmup goes on (lr), the same batches (loss)
        assert a["lr"] == b["lr"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a, b)
    _same_weights(whole, tmp_path / "halves")
    monkeypatch.chdir(tmp_path)  # refused in this process, before any rank starts
    assert _one_line(capsys, *_RUN, "--resume", "--checkpoint", "halves") == (
        f"pippy-split train: --resume: the run in halves has trained {_STEPS} steps and --steps {_STEPS} is the "
        f"total, not more steps: pass --steps above {_STEPS} to train on")


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_ctrl_c_stops_at_a_step_with_one_line_and_its_resume_command_ends_as_one_run(whole, tmp_path):
    """Issue 40: SIGINT to the launching process of a real 2-rank run (a terminal's Ctrl-C also reaches the
    ranks; a scheduler's SIGTERM reaches the launcher as this does). It used to print a 22-line traceback and
    keep only metrics.jsonl."""
    env = dict(os.environ, COLUMNS="160")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = subprocess.Popen([sys.executable, "-m", "pippy_split.cli", "train", *_RUN, "--checkpoint", "stopped"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = tmp_path / "stopped" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None:
        assert time.monotonic() < deadline, "no step in 300 s"
        time.sleep(0.02)
    run.send_signal(signal.SIGINT)  # after the first step: mid-run
    out, err = run.communicate(timeout=300)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert run.returncode == 128 + signal.SIGINT and len(lines) == 1, (run.returncode, out, err)
    said = re.fullmatch(r"pippy-split train: interrupted at step (\d+); resume with: (pippy-split train .*)", lines[0])
    assert said and 1 <= int(said.group(1)) < _STEPS, lines
    assert not (tmp_path / "stopped" / "model.pt").exists()  # only train_state/: the newest complete state
    assert len(_records(tmp_path / "stopped")) == int(said.group(1))
    resumed = _ok(_cli(*shlex.split(said.group(2))[1:], cwd=tmp_path))  # the command, as the line gives it
    assert f"resumed at step {said.group(1)} of {_STEPS}" in resumed
    assert f"({_STEPS - int(said.group(1))} steps, " in resumed, resumed
    assert [r["step"] for r in _records(tmp_path / "stopped")] == list(range(1, _STEPS + 1))
    _same_weights(whole, tmp_path / "stopped")
