"""The rank side of the multi-rank test harness (:mod:`pippy_split.testing`).

What runs inside each rank process that :func:`pippy_split.testing.run_ranks`
starts: take the caller's stdout/stderr and environment, die with the harness,
join the gloo group through a ``FileStore``, run the function, pickle its result
back, dump Python stacks on request (``SIGUSR1``), and leave only once every rank
is done. Kept apart from the parent side so that each half reads alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankSpec", "rank_main", "stack_path"]  # for the parent side (``harness``)


def stack_path(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank{rank}.stacks")


class _InheritedFd:
    """A file descriptor of the caller, duplicated into the rank when it starts.

    A forkserver rank would otherwise write to whatever stdout the server had
    when it started (under pytest: the capture file of an earlier test).
    """

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple:
        # DupFd only works while multiprocessing is starting a process, which is
        # exactly when the rank's arguments are pickled.
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> int:
    return dup.detach()


@dataclass
class RankSpec:
    """Everything a rank needs to join the group (pickled once per rank)."""

    rank: int
    world_size: int
    tmp: str  # the run's temporary directory: FileStore and stack dumps
    backend: str
    threads: int
    env: dict[str, str]  # the complete environment of the rank
    timeout: float
    harness_pid: int = field(default_factory=os.getpid)
    # Ints again once unpickled in the rank (see _InheritedFd).
    stdout: Any = field(default_factory=lambda: _InheritedFd(1))
    stderr: Any = field(default_factory=lambda: _InheritedFd(2))


def rank_main(spec: RankSpec, fn: Callable, args: tuple, conn: Connection) -> None:
    """Entry point of one rank: set up, run ``fn``, report, tear down."""
    _die_with_parent(spec.harness_pid)
    _redirect_output(spec.stdout, spec.stderr)
    # A forkserver rank inherits the server's environment; give it the caller's.
    os.environ.clear()
    os.environ.update(spec.env)
    torch.set_num_threads(spec.threads)
    stack_file = open(stack_path(spec.tmp, spec.rank), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    store = None
    try:
        store = _init_group(spec)
        result = fn(spec.rank, spec.world_size, *args)
        report: tuple[str, bytes | str, float] = ("ok", _pickle_result(result), time.time())
    except BaseException:
        # The time lets the harness tell the first failure from its echoes.
        report = ("error", traceback.format_exc(), time.time())
    conn.send(report)
    conn.close()
    if report[0] == "ok" and store is not None:
        # Stay until every rank is done: a rank that leaves early closes its gloo
        # connections under peers still receiving from it. A peer that failed
        # never arrives, and the harness kills this rank.
        with contextlib.suppress(Exception):
            _store_barrier(store, "done", spec)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # The report is sent: skip interpreter teardown, slow with torch loaded.
    os._exit(0)


def _init_group(spec: RankSpec) -> dist.Store:
    store = dist.FileStore(os.path.join(spec.tmp, "store"), spec.world_size)
    store.set_timeout(timedelta(seconds=spec.timeout))
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout),
    )
    # init_process_group can return on one rank while a peer is still connecting
    # to it; if fn then returned at once and the rank exited, the peer's init
    # would fail. Start fn only when every rank is fully connected.
    _store_barrier(store, "started", spec)
    return store


def _store_barrier(store: dist.Store, name: str, spec: RankSpec) -> None:
    """Wait until every rank has reached ``name`` (through the store: any backend)."""
    store.set(f"pippy_split/{name}/{spec.rank}", "1")
    store.wait([f"pippy_split/{name}/{r}" for r in range(spec.world_size)])


def _redirect_output(stdout: int, stderr: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for src, dst in ((stdout, 1), (stderr, 2)):
        if src != dst:
            os.dup2(src, dst)
            os.close(src)


def _pickle_result(result: Any) -> bytes:
    # Plain pickle, not multiprocessing's: torch registers shared-memory reducers
    # there, and those need this process alive until the parent has unpickled.
    detached = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), result)
    try:
        return pickle.dumps(detached)
    except Exception as e:
        raise TypeError(f"the return value of the rank function cannot be pickled: {e}") from e


def _die_with_parent(harness_pid: int) -> None:
    """On Linux, have the kernel kill this rank if its parent process dies.

    The parent is the harness (spawn) or the forkserver, which itself exits
    when the harness does.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        return
    try:
        os.kill(harness_pid, 0)
    except ProcessLookupError:  # the harness died before prctl took effect
        os._exit(1)
