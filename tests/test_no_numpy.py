"""The main job and the checkpoint path on a machine without numpy.

torch does not depend on numpy, and ``pip install torch==2.13.0 && pip install -e .``
installs none; the test extra does (through transformers), so without these tests
the suite could not see code that needs it. Each test runs in a subprocess whose
``sitecustomize`` makes ``import numpy`` fail before torch is imported, as it does on
a fresh machine, and whose child processes (the ranks) inherit that.

torch's object collectives (``all_gather_object``, ``broadcast_object_list``,
``gather_object``, ``scatter_object_list``, and so DCP's own multi-rank save and
load) decode with ``tensor.numpy()``: ``RuntimeError: Numpy is not available``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = "import sys\nsys.modules['numpy'] = None  # import numpy fails, as where it is not installed\n"


def _env(tmp_path) -> dict:
    site = tmp_path / "no_numpy_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCK)
    env = dict(os.environ, COLUMNS="160")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), REPO, env.get("PYTHONPATH", "")) if p)
    return env


def _run(tmp_path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path,
                       env=_env(tmp_path), timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def _numpy_is_blocked() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return True
    return False


def _part(rank: int, value: float) -> nn.Module:
    """Rank r's share of a two-layer model: keys ``a.*`` on rank 0, ``b.*`` on rank 1."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 2)})
    del model["b" if rank == 0 else "a"]
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def save_load_body(rank: int, world: int, path: str) -> dict:
    """Save this rank's part with AdamW state, then load it into other values; under run_ranks."""
    from pippy_split import checkpoint

    assert _numpy_is_blocked()
    part = _part(rank, 1.0 + rank)
    opt = torch.optim.AdamW(part.parameters(), lr=0.1)
    sum(p.sum() for p in part.parameters()).backward()
    opt.step()
    checkpoint.save(path, part, opt, extra={"step": 1})
    saved = {k: v.clone() for k, v in part.state_dict().items()}

    fresh = _part(rank, -5.0)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.7)
    extra = checkpoint.load(path, fresh, opt2)
    same = all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    steps = [float(s["step"]) for s in opt2.state.values()]
    return {"extra": extra, "same": same, "lr": opt2.param_groups[0]["lr"], "steps": steps,
            "keys": sorted(checkpoint.saved_keys(path))}


_DRIVER = """
import sys
from pippy_split.testing import run_ranks
from tests.test_no_numpy import _numpy_is_blocked, save_load_body
assert _numpy_is_blocked()
for r in run_ranks(save_load_body, 2, sys.argv[1], timeout=50):
    print(r)
"""


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_checkpoint_save_and_load_on_two_ranks_without_numpy(tmp_path):
    r = _run(tmp_path, "-c", _DRIVER, str(tmp_path / "ckpt"))
    results = [eval(line) for line in r.stdout.strip().splitlines()]  # dicts of plain values
    assert len(results) == 2
    for res in results:
        assert res["extra"] == {"step": 1} and res["same"] and res["lr"] == 0.1 and res["steps"] == [1.0, 1.0]
        assert res["keys"] == ["a.bias", "a.weight", "b.bias", "b.weight"]


@pytest.mark.timeout(120)
def test_main_job_without_numpy_saves_and_samples(tmp_path):
    """README's main job, short: trains, writes both checkpoints, prints samples; then resumes."""
    ckpt = tmp_path / "ckpt"
    r = _run(tmp_path, "-m", "pippy_split.cli", "train", "--steps", "2", "--samples", "2",
             "--checkpoint", str(ckpt), timeout=100)
    assert "correct sums" in r.stdout and "checkpoint saved to" in r.stdout, r.stdout
    assert (ckpt / "model.pt").is_file() and (ckpt / "train_state" / ".metadata").is_file()
    r = _run(tmp_path, "-m", "pippy_split.cli", "train", "--steps", "3", "--samples", "1",
             "--checkpoint", str(ckpt), "--resume", timeout=100)
    assert "resumed at step 2 of 3" in r.stdout, r.stdout
