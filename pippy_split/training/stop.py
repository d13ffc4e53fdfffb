"""A rank asked to stop: SIGINT or SIGTERM noted, and every rank agreeing to stop at the same step.

Where this sits: installed by :func:`pippy_split.training.loop.worker` before anything else
on a rank, read by the loop at each step boundary. Ctrl-C in a terminal reaches every
process of the job; a scheduler's SIGTERM (or a Ctrl-C to the launching process) reaches
the launcher, which hands it to every rank. Either way no rank stops alone: at each step
boundary the ranks all-reduce whether any of them was asked (one integer, the world's
group), so all of them stop after the same step and save a state ``--resume`` continues.
A second signal stops the rank at once, as without the handler. (When the launcher stops
the ranks because one failed, the others stop at their next message to it: its
connections are closed.)

Example:
    >>> stop = StopRequest()
    >>> stop.requested, stop.agreed(torch.device("cpu"))  # no process group: this process's own
    (None, False)
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["StopRequest", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Whether this rank was asked to stop (``requested``: the signal's number), and the ranks' agreement."""

    def __init__(self) -> None:
        self.requested: int | None = None

    def install(self) -> StopRequest:
        """Note SIGINT and SIGTERM instead of dying (main thread only; elsewhere nothing is installed)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # asked twice (Ctrl-C again): stop now, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = signum

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop: the same answer on every rank (one all-reduce of one integer)."""
        flag = torch.tensor([self.requested or 0], dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()) and not self.requested:
            self.requested = int(flag.item())
        return bool(flag.item())
