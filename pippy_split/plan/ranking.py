"""Ranking a plan's candidates with ties: fastest first, and candidates whose predicted step
times cannot be told apart (within a resolution, or within their measured spreads) share a place.

Part of the planner (:mod:`.report`'s ``Plan`` ranks its candidates with these); reads
candidates duck-typed (:class:`Ranked`), so it imports nothing of the planner.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

__all__ = ["Ranked", "rank_with_ties", "ties"]


class Ranked(Protocol):
    """What ranking reads and writes of a candidate."""

    rank: int

    @property
    def fits(self) -> bool: ...
    @property
    def step_time(self) -> float: ...
    @property
    def peak(self) -> float: ...
    @property
    def spread(self) -> float | None: ...


R = TypeVar("R", bound=Ranked)


def rank_with_ties(candidates: list[R], resolution: float, spreads: bool = True) -> list[R]:
    """Fitting candidates first, by predicted step time; each run of consecutive candidates
    that :func:`ties` with the run's fastest shares its ``rank`` (the order stays by time).

    Example:
        >>> from types import SimpleNamespace as C
        >>> cands = [C(schedule="1F1B", fits=True, step_time=1.10, peak=1.0, spread=None, rank=0),
        ...          C(schedule="DualPipeV", fits=True, step_time=1.004, peak=2.0, spread=None, rank=0),
        ...          C(schedule="ZBVZeroBubble", fits=True, step_time=1.00, peak=2.0, spread=None, rank=0),
        ...          C(schedule="GPipe", fits=False, step_time=0.90, peak=9.0, spread=None, rank=0)]
        >>> [(c.schedule, c.rank) for c in rank_with_ties(cands, 0.01)]  # rank 0: does not fit
        [('ZBVZeroBubble', 1), ('DualPipeV', 1), ('1F1B', 2), ('GPipe', 0)]
    """
    by_time = sorted(candidates, key=lambda c: (not c.fits, c.step_time, c.peak))
    out: list[R] = []
    place = 0
    while by_time:
        head = by_time[0]
        size = next((k for k, c in enumerate(by_time) if c.fits != head.fits or not ties(head, c, resolution, spreads)),
                    len(by_time))
        place += 1
        for c in by_time[:size]:
            c.rank = place if c.fits else 0
            out.append(c)
        by_time = by_time[size:]
    return out


def ties(head: Ranked, other: Ranked, resolution: float, spreads: bool = True) -> bool:
    """Whether ``other`` (no faster than ``head``) cannot be told from ``head``: within
    ``resolution`` of it, or, with ``spreads``, where their predictions' own spreads
    overlap (``head.step_time x (1 + head.spread)`` reaches ``other.step_time x (1 -
    other.spread)``; a candidate simulated from op sums has none).

    Example:
        >>> from types import SimpleNamespace as C
        >>> a, b = C(step_time=1.00, spread=0.02), C(step_time=1.03, spread=0.02)
        >>> ties(a, b, 0.01), ties(a, b, 0.01, spreads=False)
        (True, False)
    """
    margin = head.step_time * resolution
    if spreads:
        margin = max(margin, head.step_time * (head.spread or 0.0) + other.step_time * (other.spread or 0.0))
    return other.step_time - head.step_time <= margin
