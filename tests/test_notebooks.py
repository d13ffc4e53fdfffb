"""Tutorials opened as notebooks show objects, not printed text.

Each tutorial here is converted by jupytext and executed cell by cell in a real
Jupyter kernel (nbclient + ipykernel), from a scratch directory. The cells that
show a Pipe, a Simulation or a schedule must produce rich outputs: ``text/html``
with the pipe's table, and an SVG timeline. ``tests/test_tutorials.py`` runs the
same files as plain scripts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
_MISSING = [m for m in ("jupytext", "nbclient", "ipykernel") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"running notebooks needs {', '.join(_MISSING)} "
                                                        "(pip install jupytext nbclient ipykernel)")


def _run(name: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Execute a tutorial as a notebook; every code cell's outputs, in order."""
    import jupytext
    from nbclient import NotebookClient

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel inherits it; see test_tutorials.py
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    nb = jupytext.read(TUTORIALS / name)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def _html(outputs: list[dict]) -> list[str]:
    return [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]


def _svgs(outputs: list[dict]) -> list[str]:
    return ([o["data"]["image/svg+xml"] for o in outputs if "image/svg+xml" in o.get("data", {})]
            + [h for h in _html(outputs) if "<svg" in h])


@pytest.mark.timeout(300)
def test_skip_connections_notebook_shows_the_pipe_and_the_schedule(tmp_path, monkeypatch) -> None:
    outputs = _run("02_skip_connections.py", tmp_path, monkeypatch)
    html = _html(outputs)
    assert any("Pipe of TinyUNet" in h and "down2" in h for h in html), "the pipe's stage table, as HTML"
    assert any('class="pippy-split-schedule"' in h for h in html), "the schedule's table and timeline"
    assert _svgs(outputs)
    assert not list(tmp_path.iterdir()), "the notebook left files in its working directory"


@pytest.mark.timeout(300)
def test_schedules_notebook_draws_timelines_inline(tmp_path, monkeypatch) -> None:
    outputs = _run("03_schedules_and_placement.py", tmp_path, monkeypatch)
    svgs = _svgs(outputs)
    assert len(svgs) >= 2, "the 1F1B and ZBV simulations, drawn inline"
    assert any("0F0" in s and "rank 1" in s for s in svgs)
    assert not any("SVG timeline written to" in o.get("text", "") for o in outputs), "no temp-file detour"
