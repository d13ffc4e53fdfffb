"""Which activations are alive together on a rank, and slots they can share
(``analyze_pipeline_activation_liveness``, torch 2.15's public name).

Part of the drop-in (:mod:`pippy_split.compat`). Pure arithmetic over a schedule's order:
on one rank, the activations a forward ``F`` of (stage, microbatch) keeps for backward are
alive from that ``F`` through the action that ends them, a full backward ``B`` or, when the
backward is split, the weight half ``W`` (the input half ``I`` still leaves them to ``W``).
Lifetimes are then packed into as few slots as possible, greedily by start: a slot is free
again once its activation died at an earlier position than the next one is born, so two
lifetimes that meet at one position never share.

Positions index ``sched.lowered[rank]``, this rank's actions with their sends and receives
(the peer's multi-stage schedules index theirs with communication too; the slots and their
count depend only on the order of the compute actions, so they agree with the peer's).
"""

from __future__ import annotations

import heapq
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..schedule import ActionKind, PipelineSchedule

__all__ = ["PipelineActivationLiveness", "analyze_pipeline_activation_liveness"]

Granularity = Literal["microbatch", "stage_microbatch"]


@dataclass(frozen=True)
class PipelineActivationLiveness:
    """Activation slots of one rank: which (stage, microbatch) activations may share storage.

    Attributes:
        pp_rank: the pipeline rank analysed.
        granularity: ``"stage_microbatch"`` (one lifetime per (stage, microbatch)) or
            ``"microbatch"`` (the chosen stages of one microbatch share one lifetime, from the
            first of their forwards to the last of their releases, and so one slot).
        stage_indices: the stages analysed (stages of ``pp_rank``).
        num_microbatches: the schedule's microbatches.
        slot_by_stage_and_microbatch: ``{(stage, mb): slot}``, read-only.
        num_slots: slots needed.
    """

    pp_rank: int
    granularity: Granularity
    stage_indices: tuple[int, ...]
    num_microbatches: int
    slot_by_stage_and_microbatch: Mapping[tuple[int, int], int]
    num_slots: int
    lifetimes: Mapping[tuple[int, int], tuple[int, int]] = field(repr=False, default_factory=dict)
    __hash__ = None  # type: ignore[assignment]  # holds mappings: compared by value, never hashed

    def slot_for(self, stage_index: int, microbatch_index: int) -> int:
        """The slot of (stage, microbatch); ValueError for a pair not analysed."""
        try:
            return self.slot_by_stage_and_microbatch[(stage_index, microbatch_index)]
        except KeyError:
            raise ValueError(f"stage {stage_index}, microbatch {microbatch_index} was not analysed (stages "
                             f"{list(self.stage_indices)}, {self.num_microbatches} microbatches)") from None

    def get_activation_lifetime(self, stage_index: int, microbatch_index: int) -> tuple[int, int]:
        """``(born, released)``: positions in ``sched.lowered[pp_rank]``, both inclusive."""
        try:
            return self.lifetimes[(stage_index, microbatch_index)]
        except KeyError:
            raise ValueError(f"stage {stage_index}, microbatch {microbatch_index} was not analysed (stages "
                             f"{list(self.stage_indices)}, {self.num_microbatches} microbatches)") from None


def analyze_pipeline_activation_liveness(schedule: PipelineSchedule, *, pp_rank: int, stage_indices: Sequence[int],
                                         granularity: Granularity) -> PipelineActivationLiveness:
    """Lifetimes of the activations ``stage_indices`` keep on ``pp_rank`` and the slots they fit in.

    Args:
        schedule: any pippy_split (or compat) schedule; every rank's order is known on every rank.
        pp_rank: the pipeline rank to analyse.
        stage_indices: stages held by ``pp_rank``, each run once per microbatch there.
        granularity: ``"stage_microbatch"`` or ``"microbatch"`` (see :class:`PipelineActivationLiveness`).

    Returns:
        A :class:`PipelineActivationLiveness`.

    Raises:
        ValueError: an unknown granularity, no or repeated stages, a rank not in the schedule, or
            a chosen (stage, microbatch) without exactly one forward and one release on that rank.

    Example:
        >>> from pippy_split.schedule import get_schedule_class
        >>> order = get_schedule_class("1F1B").compute_order(num_ranks=2, n_microbatches=3, stages_per_rank=1)
        >>> lifetimes = _lifetimes([a for a in order[1] if a is not None], (1,), 3)
        >>> _slots([lifetimes[(1, mb)] for mb in range(3)])  # the last rank frees each before the next forward
        ([0, 0, 0], 1)
    """
    if granularity not in ("microbatch", "stage_microbatch"):
        raise ValueError(f"granularity must be 'microbatch' or 'stage_microbatch', got {granularity!r}")
    stages = tuple(stage_indices)
    if not stages or len(set(stages)) != len(stages):
        raise ValueError(f"stage_indices must name at least one stage, each once; got {list(stages)}")
    if pp_rank not in schedule.lowered:
        raise ValueError(f"rank {pp_rank} is not in the schedule (ranks {sorted(schedule.lowered)})")
    n = schedule.n_microbatches
    lives = _lifetimes(schedule.lowered[pp_rank], stages, n)
    if granularity == "microbatch":
        per_mb = [(min(lives[(s, mb)][0] for s in stages), max(lives[(s, mb)][1] for s in stages)) for mb in range(n)]
        slots_mb, count = _slots(per_mb)
        keys = sorted(lives)
        slots = {k: slots_mb[k[1]] for k in keys}
        lives = {k: per_mb[k[1]] for k in keys}
    else:
        keys = sorted(lives)
        order, count = _slots([lives[k] for k in keys])
        slots = dict(zip(keys, order))
    return PipelineActivationLiveness(pp_rank, granularity, stages, n, types.MappingProxyType(slots), count,
                                      types.MappingProxyType(lives))


def _lifetimes(actions: Sequence, stages: tuple[int, ...], n: int) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(stage, mb): (position of F, position of B or W)}`` over one rank's actions."""
    born: dict[tuple[int, int], int] = {}
    released: dict[tuple[int, int], int] = {}
    for pos, a in enumerate(actions):
        if a is None or a.stage not in stages or a.kind not in (ActionKind.F, ActionKind.B, ActionKind.W):
            continue
        if not 0 <= a.mb < n:
            raise ValueError(f"action {a} at position {pos}: microbatch {a.mb} outside 0..{n - 1}")
        seen = born if a.kind is ActionKind.F else released
        if (a.stage, a.mb) in seen:
            raise ValueError(f"action {a} at position {pos}: stage {a.stage}, microbatch {a.mb} already has one")
        seen[(a.stage, a.mb)] = pos
    wanted = {(s, mb) for s in stages for mb in range(n)}
    for what, got in (("forward", born), ("backward releasing it (B or W)", released)):
        if set(got) != wanted:
            missing = sorted(wanted - set(got))
            raise ValueError(f"this rank's order has no {what} for (stage, microbatch) {missing[:8]}; are stages "
                             f"{list(stages)} all held by this rank?")
    for key in wanted:
        if released[key] < born[key]:
            raise ValueError(f"stage {key[0]}, microbatch {key[1]}: released at {released[key]} before its forward "
                             f"at {born[key]}")
    return {k: (born[k], released[k]) for k in sorted(wanted)}


def _slots(intervals: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """A slot per inclusive interval, fewest slots: by start, the lowest slot already free."""
    slot_of = [0] * len(intervals)
    busy: list[tuple[int, int]] = []  # (last position, slot) of the live intervals
    free: list[int] = []
    count = 0
    for i in sorted(range(len(intervals)), key=lambda k: (intervals[k], k)):
        start, end = intervals[i]
        while busy and busy[0][0] < start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slot_of[i] = heapq.heappop(free)
        else:
            slot_of[i], count = count, count + 1
        heapq.heappush(busy, (end, slot_of[i]))
    return slot_of, count
