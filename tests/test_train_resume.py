"""`pippy-split train --resume` continues a run where it stopped: the step count (metrics.jsonl goes on), the
LR schedule and the data order, to --steps in all; it ends where one uninterrupted run ends."""

from __future__ import annotations

import json

import pytest
import torch

from pippy_split.training.setup import load_model_file

from .test_cli import _cli, _ok

_RUN = ("--steps", "4", "--batch-size", "32", "--samples", "0", "--lr-schedule", "constant", "--warmup-steps", "3",
        "--log-every", "1")


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_resume_continues_steps_lr_and_data_to_the_total(tmp_path, capsys, monkeypatch):
    from .test_train_errors import _one_line

    _ok(_cli("train", *_RUN, "--checkpoint", "whole", cwd=tmp_path))
    _ok(_cli("train", *_RUN, "--steps", "2", "--checkpoint", "halves", cwd=tmp_path))
    out = _ok(_cli("train", *_RUN, "--resume", "--checkpoint", "halves", cwd=tmp_path))
    assert "resumed at step 2 of 4" in out, out
    whole, halves = _records(tmp_path / "whole"), _records(tmp_path / "halves")
    assert [r["step"] for r in halves] == [1, 2, 3, 4]
    for a, b in zip(whole, halves, strict=True):  # warmup goes on (lr), the same batches (loss)
        assert a["lr"] == b["lr"] and a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a, b)
    saved, resumed = (load_model_file(str(tmp_path / d)) for d in ("whole", "halves"))
    assert resumed["meta"]["losses"] == pytest.approx(saved["meta"]["losses"], abs=1e-6)
    for k, v in saved["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][k], v, atol=1e-6, rtol=0, msg=k)
    monkeypatch.chdir(tmp_path)  # refused in this process, before any rank starts
    assert _one_line(capsys, *_RUN, "--resume", "--checkpoint", "halves") == (
        "pippy-split train: --resume: the run in halves has trained 4 steps and --steps 4 is the total, not more "
        "steps: pass --steps above 4 to train on")
