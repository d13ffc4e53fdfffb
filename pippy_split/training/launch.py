"""Starting the job's local ranks: torch's elastic launcher, spawned, quiet; what ends them, in words.

Where this sits: the launching process of ``pippy-split train`` and ``pippy-split generate``
(:mod:`pippy_split.train`, :mod:`pippy_split.training.generate_run`). Ranks are spawned,
never forked: the launcher's agent runs its rendezvous store on threads in this process,
and a fork taken while another thread holds a lock can leave a child blocked forever. A
failed rank comes back as a :class:`~pippy_split.training.errors.JobError` (its line
names the rank and the cause; its frames are the user's, or a bug's own traceback); a
SIGINT or SIGTERM to this process is handed to every rank by the launcher and comes back
as :class:`Interrupted` once the ranks have stopped.

Example:
    >>> 1024 <= rendezvous_port() < 65536
    True
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .errors import RankFailed, failure_line, rank_traceback

__all__ = ["launch", "Interrupted", "rendezvous_port", "quiet_launcher", "STOP_GRACE_S"]

STOP_GRACE_S = 120
"""Seconds the ranks have, after a stop signal, to reach a step boundary and save before they are killed."""


class Interrupted(Exception):
    """The launching process got SIGINT or SIGTERM; every rank has stopped (``signum``: which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def rendezvous_port() -> int:
    """A TCP port free on this host now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


class _DropShutdownNotes(logging.Filter):
    """The agent's note that it got a signal and is stopping the workers: :class:`Interrupted` says so."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in str(record.msg)


@contextlib.contextmanager
def quiet_launcher() -> Iterator[None]:
    """The launcher's own reports of a failed or stopped rank (its traceback through the launcher's frames,
    the SIGTERM of the others, its note about a signal) are left out: the caller says which rank failed and
    why. Its warnings about restarting the group (``--max-restarts``) still show."""
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic.multiprocessing.api",
                                              "torch.multiprocessing.spawn")]
    levels = [lg.level for lg in loggers]
    agent, notes = logging.getLogger("torch.distributed.elastic.agent.server.api"), _DropShutdownNotes()
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    agent.addFilter(notes)
    try:
        yield
    finally:
        agent.removeFilter(notes)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def launch(fn: Callable[..., Any], args: tuple, *, ranks: int, name: str, max_restarts: int = 0,
           command: str = "train") -> dict[int, Any]:
    """``fn(*args)`` on ``ranks`` spawned local ranks; ``{rank: return value}``.

    Raises:
        RankFailed: a rank failed (its line names the rank and the cause, ``pippy-split COMMAND: rank N
            failed: ...`` without the prefix).
        Interrupted: this process got SIGINT or SIGTERM; the ranks had ``STOP_GRACE_S`` to stop.
    """
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, rdzv_backend="c10d",
                          rdzv_endpoint=f"localhost:{rendezvous_port()}", run_id=f"{name}-{os.getpid()}",
                          max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
                          shutdown_timeout=STOP_GRACE_S)
    try:
        with quiet_launcher():
            return dict(elastic_launch(config, fn)(*args))
    except ChildFailedError as e:
        line = failure_line(e, command).removeprefix(f"pippy-split {command}: ")
        raise RankFailed(line, rank_traceback(e)) from None
    except SignalException as e:
        raise Interrupted(int(e.sigval)) from None
