"""The small things of the `pippy-split` command: --version, a fast --help, one line for a
split that cannot be made, a hint when nothing splits the model, no numpy warning.

Most run in this process (``main([...])``); the import checks run in a fresh one.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

import pippy_split
from pippy_split.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FACTORY = '''
import torch
from torch import nn


def stack():
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), (torch.randn(4, 8),)
'''

_IMPORTS = """
import json, sys
from pippy_split.cli import main
for argv in (["--help"], ["--version"], ["train", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
heavy = ("torch", "pippy_split.train", "pippy_split.training.loop", "pippy_split.split", "pippy_split.schedule")
print(json.dumps({m: m in sys.modules for m in heavy}), file=sys.stderr)
"""


def _python(*args: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                       env=env or dict(os.environ, COLUMNS="160"), cwd=cwd)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def imported_by_help() -> dict[str, bool]:
    """Which heavy modules ``--help``, ``--version`` and ``train --help`` import, in a fresh process."""
    r = _python("-c", _IMPORTS)
    return json.loads(r.stderr.strip().splitlines()[-1])


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pippy-split {pippy_split.__version__}"
    assert pippy_split.__version__ == importlib.metadata.version("pippy-split")


def test_version_of_a_checkout_that_was_never_installed_comes_from_pyproject(monkeypatch):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as f:
        stated = next(line.split('"')[1] for line in f if line.startswith("version"))
    assert pippy_split._version() == stated


def test_help_does_not_import_the_training_job(imported_by_help):
    assert not imported_by_help["pippy_split.train"] and not imported_by_help["pippy_split.training.loop"]


def test_help_and_version_import_no_torch(imported_by_help):
    """``import pippy_split`` is lazy (PEP 562): ``--help`` answers without torch's seconds of import."""
    assert imported_by_help == dict.fromkeys(imported_by_help, False)


def test_every_public_name_is_the_defining_modules_object():
    import pippy_split.microbatch
    import pippy_split.schedule
    import pippy_split.split
    import pippy_split.stage

    assert pippy_split.pipeline is pippy_split.split.pipeline
    assert pippy_split.Microbatches is pippy_split.microbatch.Microbatches
    assert pippy_split.Schedule1F1B is pippy_split.schedule.Schedule1F1B
    assert pippy_split.PipelineStage is pippy_split.stage.PipelineStage
    assert pippy_split.checkpoint.save.__module__.startswith("pippy_split.checkpoint")
    import pippy_split.parallelize
    import pippy_split.plan  # submodules named like the functions: importing them rebinds nothing

    assert callable(pippy_split.plan) and pippy_split.plan.__module__ == "pippy_split.plan.search"
    assert callable(pippy_split.parallelize) and pippy_split.parallelize.__module__ == "pippy_split.parallelize"
    assert all(getattr(pippy_split, name) is not None for name in pippy_split.__all__)
    assert set(pippy_split.__all__) <= set(dir(pippy_split))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pippy_split.no_such_name  # noqa: B018


@pytest.mark.timeout(120)
def test_inspect_prints_one_line_for_a_split_error(capsys):
    assert main(["inspect", "zoo:mlp_stack", "--split", "no.such.module"]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"pippy-split inspect failed: SplitError: {err.split('SplitError: ', 1)[1].strip()}"]
    assert "no.such.module" in err and "Traceback" not in out + err


@pytest.mark.timeout(120)
def test_inspect_without_a_split_hints_how_to_split(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # module:factory targets put the cwd on it
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["inspect", "my_models:stack"]) == 0
    out = capsys.readouterr().out
    assert "Pipe of Sequential: 1 stage" in out  # still shown, as one stage
    assert "--split" in out and "--stages N" in out and "e.g. --split 2" in out

    assert main(["inspect", "my_models:stack", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["num_stages"] == 1 and "--stages N" in err  # the hint stays out of the JSON

    assert main(["inspect", "my_models:stack", "--stages", "2"]) == 0
    assert "hint" not in capsys.readouterr().out
    sys.modules.pop("my_models", None)


def test_plot_charts_a_run_s_metrics_as_svg_without_matplotlib(tmp_path, capsys):
    """Issue 40: a loss and throughput chart a person can open, on demand for a run directory."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "tokens_per_s": 50.0 * s})
                                               + "\n" for s in range(1, 6)) + '{"step": 5, "eval_loss": 0.9}\n{"ste')
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out == f"loss and tokens/s per step, charted: {run / 'metrics.svg'}\n"
    svg = (run / "metrics.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and svg.count("<circle") == 1  # held-out: a dot
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"pippy-split plot: {tmp_path} holds no metrics.jsonl (the directory of a "
                                       "pippy-split train run)\n")
    assert "matplotlib" not in sys.modules
