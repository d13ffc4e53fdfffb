"""Tests for the multi-rank harness (pippy_split.testing.run_ranks).

Rank functions live at module top level so that they can be pickled into the
rank processes. Every test also checks that no rank process survives the call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pippy_split.testing import RankFailure, RankTimeout, free_port, harness, run_ranks

pytestmark = pytest.mark.dist


# --------------------------------------------------------------------------- #
# Rank functions
# --------------------------------------------------------------------------- #


def _write_pid(tmp: str, rank: int) -> None:
    part = Path(tmp, f".part{rank}")
    part.write_text(str(os.getpid()))
    part.replace(Path(tmp, f"pid{rank}"))  # atomic: a reader never sees it half-written


def _all_reduce(rank: int, world_size: int, tmp: str) -> tuple:
    _write_pid(tmp, rank)
    t = torch.full((3,), float(rank + 1), requires_grad=True) * 1.0  # non-leaf: harness detaches
    dist.all_reduce(t)
    return rank, world_size, t


def _explode(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


def _some_ranks_raise(rank: int, world_size: int, tmp: str, bad: tuple) -> int:
    _write_pid(tmp, rank)
    if rank in bad:
        _explode(rank)
    _sleep_forever()  # the healthy ranks are still running when the harness gives up


def _raise_while_others_wait(rank: int, world_size: int, tmp: str) -> int:
    _write_pid(tmp, rank)
    if rank == 1:
        time.sleep(0.2)  # let the others reach the barrier first
        _explode(rank)
    dist.barrier()  # fails on the healthy ranks once rank 1 is gone
    return rank


def _hang(rank: int, world_size: int, tmp: str) -> int:
    _write_pid(tmp, rank)
    if rank == 1:
        _sleep_forever()
    return rank


def _sleep_forever() -> None:
    while True:
        time.sleep(1000)


def _crash(rank: int, world_size: int, tmp: str) -> int:
    _write_pid(tmp, rank)
    if rank == 0:
        os._exit(3)
    return rank


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def _env_and_threads(rank: int, world_size: int) -> tuple:
    return os.environ.get("PIPPY_SPLIT_TEST_VAR"), torch.get_num_threads(), dist.get_world_size()


def _preloaded(rank: int, world_size: int) -> list[str]:
    import sys

    return [m for m in ("torch._dynamo", "torch._functorch.aot_autograd", "pippy_split.split", "pippy_split.generate")
            if m in sys.modules]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def _pids(tmp: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp.glob("pid*"))]


def _assert_all_gone(pids: list[int]) -> None:
    """No rank process may survive: not as a child, not as a running process."""
    assert mp.active_children() == []
    deadline = time.monotonic() + 5.0  # forkserver ranks are reaped by the server
    for pid in pids:
        while _alive(pid):
            assert time.monotonic() < deadline, f"rank process {pid} survived the harness"
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_returns_every_rank_result(world_size: int, tmp_path: Path) -> None:
    results = run_ranks(_all_reduce, world_size, str(tmp_path), timeout=30)
    expected = float(sum(range(1, world_size + 1)))
    assert [r[:2] for r in results] == [(r, world_size) for r in range(world_size)]
    for _, _, t in results:
        assert torch.equal(t, torch.full((3,), expected))
        assert not t.requires_grad
    pids = _pids(tmp_path)
    assert len(set(pids)) == world_size and os.getpid() not in pids
    _assert_all_gone(pids)


@pytest.mark.timeout(150)
def test_spawn_start_method(tmp_path: Path) -> None:
    # Each spawn rank imports torch afresh: seconds on an idle box, more under load.
    results = run_ranks(_all_reduce, 2, str(tmp_path), timeout=120, start_method="spawn")
    assert [r[0] for r in results] == [0, 1]
    _assert_all_gone(_pids(tmp_path))


@pytest.mark.timeout(60)
def test_failing_rank_is_named_with_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_some_ranks_raise, 3, str(tmp_path), (1,), timeout=30)
    assert time.monotonic() - start < 20, "a failure must not wait for the timeout"
    err = info.value
    assert not isinstance(err, RankTimeout)
    assert list(err.failures) == [1]
    assert sorted(err.killed) == [0, 2]
    msg = str(err)
    assert "--- rank 1 ---" in msg
    assert "ValueError: boom from rank 1" in msg
    assert "_explode" in msg  # the traceback itself, not just the message
    assert "[0, 2] were still running and were killed" in msg
    _assert_all_gone(_pids(tmp_path))


@pytest.mark.timeout(60)
def test_every_failing_rank_is_reported(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_some_ranks_raise, 3, str(tmp_path), (0, 2), timeout=30)
    msg = str(info.value)
    assert set(info.value.failures) == {0, 2}
    assert info.value.killed == [1]
    assert "--- rank 0 ---" in msg and "--- rank 2 ---" in msg
    assert "boom from rank 0" in msg and "boom from rank 2" in msg
    _assert_all_gone(_pids(tmp_path))


@pytest.mark.timeout(60)
def test_root_cause_comes_first(tmp_path: Path) -> None:
    # Peers blocked in a collective fail too once rank 1 exits (gloo sees the
    # connection close); the report must still lead with rank 1.
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_while_others_wait, 3, str(tmp_path), timeout=30)
    err = info.value
    assert list(err.failures)[0] == 1
    msg = str(err)
    for r in set(err.failures) - {1}:
        assert msg.index("--- rank 1 ---") < msg.index(f"--- rank {r} ---")
    assert "boom from rank 1" in str(err)
    _assert_all_gone(_pids(tmp_path))


@pytest.mark.timeout(60)
def test_hung_rank_times_out_and_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang, 2, str(tmp_path), timeout=10)
    elapsed = time.monotonic() - start
    assert 10 <= elapsed < 20
    err = info.value
    assert err.hung == [1]
    assert "ranks [1] were still running after 10 s" in str(err)
    assert "_sleep_forever" in err.stacks.get(1, "")  # where it was stuck
    _assert_all_gone(_pids(tmp_path))


@pytest.mark.timeout(60)
def test_rank_dying_without_report(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_crash, 2, str(tmp_path), timeout=30)
    assert "--- rank 0 ---" in str(info.value)
    assert "exited with exit code 3" in str(info.value)
    _assert_all_gone(_pids(tmp_path))


def _print(rank: int, world_size: int, word: str) -> None:
    print(f"{word} from rank {rank}", flush=True)


@pytest.mark.timeout(60)
def test_rank_output_reaches_the_caller(capfd: pytest.CaptureFixture) -> None:
    # A forkserver started by an earlier test must not send this test's output
    # to that test's capture.
    run_ranks(_print, 2, "hello", timeout=30)
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out


@pytest.mark.timeout(60)
def test_unpicklable_result_is_a_rank_failure() -> None:
    with pytest.raises(RankFailure, match="cannot be pickled"):
        run_ranks(_unpicklable, 1, timeout=30)
    assert mp.active_children() == []


@pytest.mark.timeout(60)
def test_env_and_threads_reach_the_ranks() -> None:
    results = run_ranks(
        _env_and_threads, 2, timeout=30, threads_per_rank=2, env={"PIPPY_SPLIT_TEST_VAR": "yes"}
    )
    assert results == [("yes", 2, 2)] * 2


@pytest.mark.timeout(60)
def test_ranks_start_with_the_tracer_and_the_library_imported() -> None:
    """Each rank would otherwise import torch.export's tracer (dynamo, AOT autograd) and the
    library itself on its first pipe: about 2 s a rank, several times that with the ranks importing
    side by side on a loaded machine. The forkserver imports them once."""
    assert run_ranks(_preloaded, 2, timeout=30) == [["torch._dynamo", "torch._functorch.aot_autograd",
                                                     "pippy_split.split", "pippy_split.generate"]] * 2


@pytest.mark.timeout(60)
def test_keyboard_interrupt_kills_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(procs, *args):
        while len(_pids(tmp_path)) < len(procs):  # ranks are up and running
            time.sleep(0.02)
        raise KeyboardInterrupt

    monkeypatch.setattr(harness, "_collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_ranks(_hang, 2, str(tmp_path), timeout=30)
    _assert_all_gone(_pids(tmp_path))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_env_and_threads, 0)
    with pytest.raises(ValueError, match="start_method"):
        run_ranks(_env_and_threads, 1, start_method="fork")


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
