"""Shared checks and small helpers for the order generators in this package.

Every generator is a pure function ``(num_ranks, n_microbatches,
stages_per_rank) -> Order``; this module holds what they have in common:
argument checks with errors that say what is required, and the per-rank
stage lists for a placement (:func:`~pippy_split.schedule.placement.local_stages`,
re-exported: a generator names its stages through it, never by formula).
"""

from __future__ import annotations

import gc
from collections import deque
from contextlib import contextmanager
from itertools import repeat
from typing import Iterable, Iterator

from ..actions import Action, ActionKind
from ..placement import local_stages

__all__ = ["check_sizes", "local_stages", "RankOps", "F", "B", "I", "W", "Action", "ZB_PAPER", "actions_of", "gc_paused"]

ZB_PAPER = "Qi et al. 2024, Zero Bubble Pipeline Parallelism (ICLR)"

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def check_sizes(
    family: str,
    num_ranks: int,
    n_microbatches: int,
    stages_per_rank: int,
    *,
    exact_stages: int | None = None,
    min_stages: int = 1,
) -> None:
    """Raise ``ValueError`` naming ``family`` and the requirement that failed."""
    if num_ranks < 1:
        raise ValueError(f"{family}: num_ranks must be >= 1, got {num_ranks}")
    if exact_stages is not None and stages_per_rank != exact_stages:
        raise ValueError(f"{family} needs exactly {exact_stages} stages per rank, got {stages_per_rank}")
    if stages_per_rank < min_stages:
        raise ValueError(f"{family} needs stages_per_rank >= {min_stages}, got {stages_per_rank}")
    if n_microbatches < 1:
        raise ValueError(f"{family} needs n_microbatches >= 1, got {n_microbatches}")


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector while a big order is built or simulated.

    Millions of new tracked objects (actions, lists) set off collections that walk
    every object alive, again and again: three quarters of building 1F1B's 4M actions.
    Nothing built here makes a cycle; the collector is switched back on as it was.
    """
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


_SETTERS = tuple(getattr(Action, name).__set__ for name in ("stage", "kind", "mb", "peer", "round"))


def actions_of(stages: Iterable[int], kinds: Iterable[ActionKind], mbs: Iterable[int], n: int) -> list[Action]:
    """``[Action(s, k, mb) for s, k, mb in zip(stages, kinds, mbs)]`` (``n`` of them), built
    in C: each slot is filled by ``map`` over its descriptor, with no Python frame per action.

    For generators of big orders (1F1B on 1024 ranks x 2048 microbatches is 4M actions,
    where ``Action.__init__`` and its checks were most of the time). The caller vouches
    for the values that ``Action.__post_init__`` would check: ``stage, mb >= 0`` ints and
    ``kind`` an ``ActionKind`` (compute actions, no peer). The results are equal, hash
    equal and print the same as ``Action(...)``.

    Example:
        >>> actions_of(repeat(1), [F, B], [0, 0], 2) == [Action(1, F, 0), Action(1, B, 0)]
        True
    """
    objs = list(map(object.__new__, repeat(Action, n)))
    for setter, values in zip(_SETTERS, (stages, kinds, mbs, repeat(None), repeat(None))):
        deque(map(setter, objs, values), maxlen=0)
    return objs


class RankOps:
    """Appends one rank's actions, numbering microbatches per stage and kind.

    Hand-written patterns (DualPipeV, ZB-V, ZB-H1) say "next forward of chunk
    1" rather than "F of mb 7"; this keeps the counting in one place. An ``I``
    queues its ``W``; :meth:`weight` runs the oldest queued one.
    """

    def __init__(self, n_microbatches: int | None = None) -> None:
        self.ops: list[Action | None] = []
        self.m = n_microbatches  # actions for mb >= m are dropped (patterns sized for more)
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.deferred_w: deque[tuple[int, int]] = deque()

    def _emit(self, stage: int, kind: ActionKind, mb: int) -> None:
        if self.m is None or mb < self.m:
            self.ops.append(Action(stage, kind, mb))

    def forward(self, stage: int) -> None:
        mb = self.next_f.get(stage, 0)
        self.next_f[stage] = mb + 1
        self._emit(stage, F, mb)

    def backward(self, stage: int, split: bool = False) -> None:
        """A full B, or (``split``) an I whose W is queued for :meth:`weight`."""
        mb = self.next_b.get(stage, 0)
        self.next_b[stage] = mb + 1
        self._emit(stage, I if split else B, mb)
        if split:
            self.deferred_w.append((stage, mb))

    def weight(self) -> None:
        if self.deferred_w:
            stage, mb = self.deferred_w.popleft()
            self._emit(stage, W, mb)

    def forwards_done(self, stage: int) -> int:
        return self.next_f.get(stage, 0)

