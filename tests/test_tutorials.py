"""Every tutorial runs as a plain script and opens as a notebook.

The tutorials (``tutorials/0X_*.py``, jupytext percent format) assert their own
claims (pipe == model, gradients match the unsplit model, the loss falls), so a
clean exit is the test. Each runs in a fresh interpreter, from a scratch working
directory so that none depends on where it is started or leaves files behind.
One intra-op thread each: at these sizes threads only add contention, and on a
busy CI machine spinning OpenMP threads make a tutorial several times slower.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parent.parent / "tutorials").glob("[0-9][0-9]_*.py"))


def test_every_tutorial_is_here_in_order():
    assert [p.name[:2] for p in TUTORIALS] == ["01", "02", "03", "04", "05", "06", "07", "08", "09"]


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_is_a_percent_notebook(path):
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(path)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds[0] == "markdown" and nb.cells[0].source.startswith("# "), "open with a titled markdown cell"
    assert "code" in kinds and kinds.count("markdown") >= 3, "prose between the code"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs_as_a_script(path, tmp_path):
    env = dict(os.environ, COLUMNS="120", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a tutorial started under torchrun would take the torchrun path
    r = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=110)
    assert r.returncode == 0, (f"{path.name} exited {r.returncode}\n"
                               f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}")
    assert not list(tmp_path.iterdir()), f"{path.name} left files in the working directory"
