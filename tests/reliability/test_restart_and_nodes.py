"""`pippy-split train` survives a SIGKILLed rank and runs across "nodes".

* Elastic restart: a rank is SIGKILLed mid-run (``--simulate-failure RANK:STEP``, on
  the first attempt only); the launcher (``pippy-split train --max-restarts 1`` or
  ``torchrun --max-restarts=1``) restarts the group; every rank resumes from the last
  complete ``--checkpoint-every`` checkpoint; the run ends with the same loss
  trajectory and bitwise the same weights as an uninterrupted run (CPU, gloo).
* Two "nodes" x 2 processes on this machine with torchrun's c10d rendezvous train
  4 stages exactly as 4 local ranks of one torchrun do.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pippy_split.testing import free_port

SMALL = ["--steps", "12", "--samples", "0", "--d-model", "32", "--batch-size", "32", "--seed", "3"]
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
             "TORCHELASTIC_RUN_ID", "GROUP_RANK")


def _env() -> dict:
    env = dict(os.environ, COLUMNS="160")
    for k in _DIST_ENV:
        env.pop(k, None)
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say where it was, not only that it took too long
        out, err = (x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}")


def _train(ckpt, *extra: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pippy_split.train", *SMALL, "--checkpoint", str(ckpt), *extra], 240)


def _torchrun(ckpt, torchrun_args: list[str], *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "pippy_split.train", *SMALL,
           "--checkpoint", str(ckpt), *extra]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    return _run(cmd, 300)


def _ok(r) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    return r.stdout


def _saved(ckpt) -> dict:
    return torch.load(os.path.join(ckpt, "model.pt"), weights_only=False)


def _assert_same_run(got: dict, want: dict) -> None:
    assert got["meta"]["losses"] == want["meta"]["losses"]  # bitwise: float equality, step by step
    assert got["state_dict"].keys() == want["state_dict"].keys()
    different = [k for k in want["state_dict"] if not torch.equal(got["state_dict"][k], want["state_dict"][k])]
    assert not different, different


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("plain") / "ckpt"
    _ok(_train(ckpt, "--checkpoint-every", "4"))
    return _saved(ckpt)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sigkilled_rank_restarts_and_resumes_bitwise_under_pippy_split_train(tmp_path, uninterrupted):
    out = _ok(_train(tmp_path / "ckpt", "--checkpoint-every", "4", "--max-restarts", "1",
                     "--simulate-failure", "1:6"))
    assert "restart 1: resumed from step 4" in out
    _assert_same_run(_saved(tmp_path / "ckpt"), uninterrupted)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sigkilled_rank_restarts_and_resumes_bitwise_under_torchrun(tmp_path, uninterrupted):
    out = _ok(_torchrun(tmp_path / "ckpt", ["--standalone", "--nproc-per-node", "2", "--max-restarts=1",
                                             "--monitor-interval", "0.2"],
                        "--checkpoint-every", "4", "--simulate-failure", "0:9"))
    assert "restart 1: resumed from step 8" in out
    _assert_same_run(_saved(tmp_path / "ckpt"), uninterrupted)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_without_max_restarts_a_killed_rank_fails_the_run_naming_it(tmp_path):
    r = _train(tmp_path / "ckpt", "--checkpoint-every", "4", "--simulate-failure", "1:2")
    assert r.returncode == 1
    # The launcher names the first failure it sees: rank 1's SIGKILL, or rank 0 losing its peer
    # (gloo says "reset" or "closed" depending on which side of the socket notices first).
    causes = ("SIGKILL", "Connection reset by peer", "Connection closed by peer", "the peer failed or went away")
    assert any(c in r.stderr for c in causes), r.stderr[-3000:]
    assert "pippy-split train: rank " in r.stderr.strip().splitlines()[-1]


@pytest.mark.dist
@pytest.mark.timeout(700)
def test_two_nodes_of_two_processes_train_four_stages_as_one_node_does(tmp_path):
    _ok(_torchrun(tmp_path / "one", ["--standalone", "--nproc-per-node", "4"], "--schedule", "1F1B"))
    port = free_port()
    nodes = [_torchrun(tmp_path / "two", ["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2",
                                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                          "--rdzv-id", "pippy-split-two-nodes"],
                       "--schedule", "1F1B", wait=False) for k in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in nodes]
    except subprocess.TimeoutExpired:
        for p in nodes:
            p.kill()
        tails = [f"node {k}:\n{o[-2000:]}\n{e[-4000:]}" for k, (o, e) in enumerate(p.communicate() for p in nodes)]
        pytest.fail("the two nodes ran past 300 s\n" + "\n".join(tails))
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(nodes, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{stdout[-3000:]}\n{stderr[-6000:]}"
    assert any("4 stages on 4 ranks" in stdout for stdout, _ in outs)
    _assert_same_run(_saved(tmp_path / "two"), _saved(tmp_path / "one"))
