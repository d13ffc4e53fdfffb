"""`pippy-split train`'s errors: the job's inputs are checked before any rank is launched (one line, exit
status 2), and a refused model.pt says what it is."""

from __future__ import annotations

import re

import pytest

from pippy_split.train import train_main as main
from pippy_split.training.config import TrainConfig
from pippy_split.training.errors import JobError
from pippy_split.training.setup import prepare


def _one_line(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_inputs_are_checked_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.json").write_text('{"vocab_size": 8}')
    (tmp_path / "mymodels.py").write_text("def build():\n    pass\n")
    run = ("--steps", "1", "--checkpoint", "run")
    assert _one_line(capsys, "--data", "missing.txt", *run) == (
        "pippy-split train: --data missing.txt: no such file or directory (a text file, a .jsonl file, or a "
        "directory saved by datasets' save_to_disk)")
    assert _one_line(capsys, "--model", "no_such_module:build", *run) == (
        "pippy-split train: --model no_such_module:build: cannot import no_such_module (ModuleNotFoundError: "
        "No module named 'no_such_module')")
    assert _one_line(capsys, "--model", "mymodels:biuld", *run) == \
        "pippy-split train: --model mymodels:biuld: module mymodels has no biuld"
    assert _one_line(capsys, "--model", "hf:bad.json", "--data", "a_file", *run) == \
        'pippy-split train: --model hf:bad.json: bad.json has no model_type (e.g. "qwen2", "llama")'
    assert _one_line(capsys, "--model", "hf:nowhere", "--data", "a_file", *run).endswith(
        "nowhere is neither a config.json file nor a directory holding one")
    line = _one_line(capsys, "--steps", "1", "--checkpoint", "a_file/run")
    assert line.startswith("pippy-split train: cannot write the run directory a_file/run: Not a directory"), line
    assert _one_line(capsys, "--resume", "--checkpoint", "fresh") == (
        "pippy-split train: --resume: fresh holds no complete state to continue (neither model.pt nor train_state/; "
        "--checkpoint or --run-name names the run)")


def test_a_random_or_cut_model_pt_is_named_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Issue 40: random bytes read as "pickled objects that could run code", a cut file as a 26-line traceback."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "whole").mkdir()
    torch.save({"state_dict": {"w": torch.zeros(4096)}, "meta": {}}, tmp_path / "whole" / "model.pt")
    data = (tmp_path / "whole" / "model.pt").read_bytes()
    for name, damaged in (("random", bytes(range(256)) * 16), ("cut", data[: len(data) // 2])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.pt").write_bytes(damaged)
        assert _one_line(capsys, "--resume", "--steps", "5", "--checkpoint", name) == (
            f"pippy-split train: {name}/model.pt is not a complete checkpoint this job wrote (it cannot be read "
            "back: cut short, or other bytes); move it away: --resume then continues from train_state/ where it is "
            "complete, else train the run again")


def test_a_run_directory_holding_a_run_is_not_overwritten(tmp_path, capsys, monkeypatch):
    """Issue 40: rerunning a run name without --resume used to truncate its metrics.jsonl and train over it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints" / "mine").mkdir(parents=True)
    (tmp_path / "checkpoints" / "mine" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert _one_line(capsys, "--steps", "1", "--run-name", "mine") == (
        "pippy-split train: checkpoints/mine already holds a run (metrics.jsonl): continue it with --resume, or "
        "train a new one under another --run-name (or --checkpoint DIR)")
    assert (tmp_path / "checkpoints" / "mine" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


def test_stage_counts_the_schedule_cannot_place_are_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """Issue 40: --ranks 3 --split with 4 stages failed inside a rank after 49 s and left an empty run directory;
    the default model on 3 ranks was another model (305,792 parameters). Now: refused here, saying what works,
    with no run directory; and the default TinyGPT is the same on any number of ranks."""
    monkeypatch.chdir(tmp_path)
    assert _one_line(capsys, "--ranks", "3", "--split", "blocks.1,blocks.2,blocks.3", "--steps", "1") == (
        "pippy-split train: --split blocks.1,blocks.2,blocks.3 makes 4 stages, which ZBVZeroBubble cannot place on "
        "3 pipeline ranks (it needs exactly 2 stages per rank (stages = 2 x ranks)); what works: 5 split points "
        "(6 stages); or --ranks 2 for these 4 stages")
    assert _one_line(capsys, "--ranks", "4", "--steps", "1") == (
        "pippy-split train: the built-in TinyGPT has 4 blocks, so it cuts into at most 6 stages (embeddings, one "
        "per block, head); ZBVZeroBubble places 8: pass --n-layer 6 or more, fewer --ranks, or a schedule with one "
        "stage per rank (1F1B)")
    assert not (tmp_path / "checkpoints").exists()
    stages = {}
    for ranks in (2, 3):
        prep = prepare(TrainConfig(ranks=ranks, seq_len=8), ranks, lambda *a, **k: None)
        assert sum(s.num_params for s in prep.pipe.stages) == 205_824, ranks
        stages[ranks] = [list(s.modules) for s in prep.pipe.stages]
    assert stages == {2: [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "ln_f", "head"]],
                      3: [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"],
                          ["ln_f", "head"]]}  # whole blocks: the run can generate


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_a_model_pt_holding_pickled_objects_is_refused_as_not_this_job_s(tmp_path, capsys):
    import torch

    from pippy_split.training.setup import load_model_file

    torch.save({"state_dict": {}, "meta": _RunsCode()}, tmp_path / "model.pt")
    with pytest.raises(JobError) as refused:
        load_model_file(str(tmp_path))
    text = refused.value.line
    assert text == (f"{tmp_path / 'model.pt'} is not a checkpoint this job wrote (it holds print); a "
                    "pickled object could run code when loaded, so it will not be loaded"), text
    assert "weights_only" not in text and "this ran" not in capsys.readouterr().out
    torch.save({"weights": torch.zeros(2)}, tmp_path / "model.pt")
    with pytest.raises(JobError, match=r"is not a checkpoint this job wrote \(no \"state_dict\" of tensors"):
        load_model_file(str(tmp_path))


_RAISING_FACTORY = '''
import torch


def _layers(width):
    raise ValueError(f"width {width} is not a layer size")


def build():
    return torch.nn.Sequential(_layers(8)), (torch.randn(4, 8),)
'''


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_an_exception_in_the_users_factory_shows_their_frames_and_one_line(tmp_path):
    """Issue 40: it reached the user as 21 lines with the launcher's and the library's frames."""
    from .test_cli import _cli

    (tmp_path / "mymodels.py").write_text(_RAISING_FACTORY)
    r = _cli("train", "--model", "mymodels:build", "--ranks", "1", "--schedule", "1F1B", "--steps", "1",
             "--checkpoint", "run", cwd=tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and lines, r.stderr
    assert lines[-1] == ("pippy-split train: rank 0 failed: --model mymodels:build raised ValueError: width 8 is not "
                         "a layer size"), r.stderr
    files = re.findall(r'File "([^"]+)"', r.stderr)
    assert files and all(f.endswith("mymodels.py") for f in files), r.stderr  # build, then _layers: theirs only
    assert "site-packages" not in r.stderr and "pippy_split/" not in r.stderr and "elastic" not in r.stderr, r.stderr
