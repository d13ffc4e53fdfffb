"""The multi-rank test harness: run a function on N local ranks joined by gloo.

Every distributed test (tests/dist/, the dist tier of the stage and schedule
tests) goes through :func:`run_ranks`, so that a failing rank always surfaces
its traceback, a hung rank is always killed, and no process outlives the call:

    def _body(rank, world_size, scale):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        return t * scale

    results = run_ranks(_body, 2, 10.0)   # [tensor([30., 30.]), tensor([30., 30.])]

The parent side is ``harness``; what runs inside a rank is in ``rank``. Ranks are
fresh processes, never forks of the caller: by default they come from
multiprocessing's "forkserver", a clean server process that imports torch once
and then forks each rank in milliseconds (a "spawn" rank re-imports torch, which
costs seconds per rank on a small CI machine). ``start_method="spawn"`` is there
for platforms without forkserver. Ranks meet through a ``FileStore`` in a fresh
temporary directory: unlike a TCP rendezvous on a port picked in advance, it
cannot collide with another run starting at the same moment, which matters when
many tests run back to back or in parallel.
"""

from __future__ import annotations

from .harness import RankFailure, RankTimeout, free_port, run_ranks

__all__ = ["RankFailure", "RankTimeout", "run_ranks", "free_port"]
