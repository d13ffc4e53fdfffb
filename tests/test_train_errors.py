"""`pippy-split train`'s errors: the job's inputs are checked before any rank is launched (one line, exit
status 2), and a refused model.pt says what it is."""

from __future__ import annotations

import pytest

from pippy_split.train import main


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
        "pippy-split train: --resume: fresh/model.pt does not exist (--checkpoint names the directory of the run "
        "to continue)")


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_a_model_pt_holding_pickled_objects_is_refused_as_not_this_job_s(tmp_path, capsys):
    import torch

    from pippy_split.training.setup import load_model_file

    torch.save({"state_dict": {}, "meta": _RunsCode()}, tmp_path / "model.pt")
    with pytest.raises(SystemExit) as refused:
        load_model_file(str(tmp_path))
    text = str(refused.value)
    assert text == (f"{tmp_path / 'model.pt'} is not a checkpoint this job wrote (it holds print); a "
                    "pickled object could run code when loaded, so it will not be loaded"), text
    assert "weights_only" not in text and "this ran" not in capsys.readouterr().out
    torch.save({"weights": torch.zeros(2)}, tmp_path / "model.pt")
    with pytest.raises(SystemExit, match=r"is not a checkpoint this job wrote \(no \"state_dict\" of tensors"):
        load_model_file(str(tmp_path))
