"""How the schedule layer says an order is wrong: :class:`ScheduleError`,
:class:`PlacementConflict` and the one deadlock message.

Sits low in ``schedule/`` (above :mod:`.actions` and :mod:`.messages` only), so that every
module that checks or runs an order (validate, lower, simulate, the schedule classes,
the collectives) raises the same error without importing the checker. An error names
the rank, the step and the action, and prints the order with the step marked
(:func:`~pippy_split.schedule.actions.format_order`).

A deadlock is described by :func:`deadlock_message` wherever it is found: by the dry run
of ``validate`` (a :class:`ScheduleError`) or by ``simulate`` (a ``ValueError``), over a
compute-only order (a rank waits for a compute action) or a lowered one (a rank's batch
waits for a message's other end).
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

from .actions import Action, Order, format_order
from .messages import Message, recv_action, send_action

__all__ = ["ScheduleError", "PlacementConflict", "Awaited", "deadlock_message"]


class ScheduleError(ValueError):
    """An order that is incomplete, mis-ordered, or would deadlock.

    Attributes:
        rank: the rank at fault (``None`` when no rank holds the stage at all).
        step: index in that rank's list (``None`` for an action that is missing).
        action: the action at fault (or the missing one).
        reason: the message without the location and the table.
    """

    def __init__(
        self,
        reason: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        action: Action | None = None,
        order: Order | None = None,
        marks: Mapping[int, int] | None = None,
    ) -> None:
        self.reason = reason
        self.rank = rank
        self.step = step
        self.action = action
        where = f"rank {'?' if rank is None else rank}, step {'-' if step is None else step}"
        message = f"{where}, action {action}: {reason}"
        if order is not None:
            if marks is None and rank is not None and step is not None:
                marks = {rank: step}
            message += "\n" + format_order(order, mark=marks)
        super().__init__(message)

    def __reduce__(self) -> tuple[Callable[..., ScheduleError], tuple]:  # rank/step/action survive pickling
        return (_rebuild_error, (str(self), self.reason, self.rank, self.step, self.action))


def _rebuild_error(message: str, reason: str, rank: int | None, step: int | None,
                   action: Action | None) -> ScheduleError:
    err = ScheduleError.__new__(ScheduleError)
    ValueError.__init__(err, message)
    err.reason, err.rank, err.step, err.action = reason, rank, step, action
    return err


class PlacementConflict(ValueError):
    """An order holds actions of one stage on two ranks (``rank``, ``step``: the second one)."""

    def __init__(self, stage: int, home: int, rank: int, step: int, action: object) -> None:
        super().__init__(f"stage {stage} has actions on rank {home} and rank {rank} "
                         f"(first seen: {action} on rank {rank}); a stage lives on one rank")
        self.stage, self.home, self.rank, self.step, self.action = stage, home, rank, step, action


Awaited = Union[Action, tuple[Message, bool]]
"""What a stuck rank waits for: a compute action (in a compute-only order), or a message
and which end of it has yet to be posted (``True``: its sender's SEND)."""

_SHORT_RANKS = 8  # a one-line message names this many stuck ranks, then counts the rest


def deadlock_message(order: Order, stuck: Mapping[int, tuple[int, Awaited]], placement: Mapping[int, int], *,
                     rule: str = "", short: bool = False) -> str:
    """Why no rank can advance: for each stuck rank, the step it stopped at and what it waits for.

    Args:
        order: the order that was run.
        stuck: ``{rank: (step, awaited)}`` for every rank that cannot go on.
        placement: ``{stage: rank}``, to say where the awaited action runs.
        rule: why a rank waits, after "no rank can advance" (e.g. NCCL's batch rule).
        short: one line naming at most 8 ranks (what ``simulate`` raises), instead of a
            line per rank (what ``validate`` raises, above the order table).

    Example:
        >>> order = {0: [Action(0, "B", 0)]}
        >>> deadlock_message(order, {0: (0, Action(0, "F", 0))}, {0: 0}, short=True)
        'schedule deadlocks: no rank can progress; rank 0 step 0 (0B0) waits for 0F0 on rank 0'
        >>> print(deadlock_message(order, {0: (0, Action(0, "F", 0))}, {0: 0}))
        deadlock: no rank can advance; 1 rank(s) stuck:
          rank 0 at step 0 (0B0) waits for 0F0 on rank 0
    """
    ranks = sorted(stuck)
    what = {r: f"({order[r][stuck[r][0]]}) waits for {_awaited(stuck[r][1], placement)}" for r in ranks}
    if short:
        clauses = [f"rank {r} step {stuck[r][0]} {what[r]}" for r in ranks[:_SHORT_RANKS]]
        more = len(ranks) - _SHORT_RANKS
        return ("schedule deadlocks: no rank can progress; " + "; ".join(clauses)
                + (f"; ... and {more} more ranks" if more > 0 else ""))
    lines = [f"  rank {r} at step {stuck[r][0]} {what[r]}" for r in ranks]
    return f"deadlock: no rank can advance{rule}; {len(ranks)} rank(s) stuck:\n" + "\n".join(lines)


def _awaited(awaited: Awaited, placement: Mapping[int, int]) -> str:
    if isinstance(awaited, Action):
        return f"{awaited} on rank {placement.get(awaited.stage, '?')}"
    message, by_sender = awaited
    other = send_action(message, True) if by_sender else recv_action(message, True)
    peer = placement.get(message.sender if by_sender else message.receiver, "?")
    return f"{other} from rank {peer} ({message})"
