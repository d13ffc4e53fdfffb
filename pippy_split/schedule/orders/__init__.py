"""Order generators: one pure function per schedule family, and their registry.

Each family module exposes ``compute_order(num_ranks, n_microbatches,
stages_per_rank) -> Order``: compute actions only (F, B, I, W) per rank in
execution order, no torch, no process group. Lowering adds the comms later.
:data:`ORDERS` says, as data, what each family needs (placement, stages per
rank, whether the backward is split) so that stage building, lowering and
validation never guess: each family module states it in module constants
(``PLACEMENT``, ``STAGES_PER_RANK``, ``MIN_STAGES_PER_RANK``, ``SPLIT_BACKWARD``,
``PAPER``) and names its stages through ``local_stages(..., PLACEMENT)``.

Example:
    >>> spec = get_order_spec("zbvzerobubble")
    >>> spec.placement, spec.stages_per_rank
    ('v', 2)
    >>> [str(a) for a in spec.compute_order(2, 4, 2)[0]][:3]
    ['0F0', '0F1', '0F2']
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from ..actions import Order
from ..placement import STYLES, PlacementArg, Style, stage_to_rank
from . import (
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    zbv_zero_bubble,
)

__all__ = ["OrderSpec", "ORDERS", "get_order_spec"]


@dataclass(frozen=True)
class OrderSpec:
    """What one schedule family is and needs."""

    name: str
    """Registry name, e.g. ``"ZBVZeroBubble"``."""
    compute_order: Callable[..., Order]
    """``(num_ranks, n_microbatches, stages_per_rank) -> Order``."""
    placement: Style
    """Stage-to-rank style the order assumes (see :mod:`..placement`)."""
    stages_per_rank: int | None
    """Fixed stages per rank, or ``None`` for any ``>= min_stages_per_rank``."""
    min_stages_per_rank: int
    """Fewest stages per rank the family accepts."""
    split_backward: bool
    """Whether the order uses I and W (else only B)."""
    paper: str
    """Where the schedule comes from."""

    def __post_init__(self) -> None:
        if self.placement not in STYLES:
            raise ValueError(f"{self.name}: placement must be 'loop' or 'v', got {self.placement!r}")
        if self.stages_per_rank is not None and self.stages_per_rank < self.min_stages_per_rank:
            raise ValueError(f"{self.name}: stages_per_rank {self.stages_per_rank} < min {self.min_stages_per_rank}")

    def default_stages_per_rank(self) -> int:
        """The fixed count, else the minimum."""
        return self.stages_per_rank if self.stages_per_rank is not None else self.min_stages_per_rank

    def stage_placement(self, num_stages: int, num_ranks: int, style: PlacementArg | None = None) -> dict[int, int]:
        """``{stage: rank}`` for this family (or under ``style``, an override), via
        :func:`~pippy_split.schedule.placement.stage_to_rank`.

        Example:
            >>> get_order_spec("ZBVZeroBubble").stage_placement(4, 2)
            {0: 0, 1: 1, 2: 1, 3: 0}
        """
        return stage_to_rank(num_stages, num_ranks, self.placement if style is None else style)

    def stage_rule(self) -> str:
        """Which stage counts the family accepts, in words.

        Example:
            >>> get_order_spec("ZBVZeroBubble").stage_rule()
            'exactly 2 stages per rank (stages = 2 x ranks)'
        """
        if self.stages_per_rank is not None:
            k = self.stages_per_rank
            return f"exactly {k} stage{'s' if k > 1 else ''} per rank (stages = {k if k > 1 else ''}{' x ' if k > 1 else ''}ranks)"
        return f"{self.min_stages_per_rank} or more stages per rank, the same on every rank (stages a multiple of ranks)"

    def fits(self, num_stages: int, num_ranks: int) -> bool:
        """Whether ``num_stages`` stages on ``num_ranks`` ranks follow :meth:`stage_rule`."""
        if num_ranks < 1 or num_stages % num_ranks:
            return False
        per_rank = num_stages // num_ranks
        if self.stages_per_rank is not None:
            return per_rank == self.stages_per_rank
        return per_rank >= self.min_stages_per_rank

    def check_stages(self, name: str, mine: list[int], num_stages: int, num_ranks: int) -> None:
        """Refuse, in words, a rank given stages ``mine`` (of ``num_stages`` on ``num_ranks``)
        that the family cannot run; ``name`` is the schedule class.

        Raises:
            ValueError: the count on this rank, or the total, breaks :meth:`stage_rule`;
                the message says what would work (:meth:`nearest`).
        """
        per_rank = len(mine)
        rule, instead = self.stage_rule(), self.nearest(num_stages, num_ranks)
        if self.stages_per_rank is not None and per_rank != self.stages_per_rank:
            raise ValueError(f"{name} needs {rule}; this rank was given {per_rank} (stages "
                             f"{mine}). What would work: {instead}")
        if per_rank < self.min_stages_per_rank:
            raise ValueError(f"{name} needs {rule}; got {per_rank}. What would work: {instead}")
        if num_stages != per_rank * num_ranks:
            raise ValueError(f"{name}: {num_stages} stages do not match {num_ranks} ranks x {per_rank} stages "
                             f"per rank = {num_ranks * per_rank} ({name} needs {rule}). What would work: {instead}")

    def nearest(self, num_stages: int, num_ranks: int) -> str:
        """What would work instead of ``num_stages`` stages on ``num_ranks`` ranks, in words."""
        per = self.default_stages_per_rank()
        options = [f"{_count(per * num_ranks, 'stage')} on {_count(num_ranks, 'rank')} "
                   f"(pipeline(model, {per * num_ranks}, ...))"]
        if num_stages % per == 0 and (self.stages_per_rank is not None or num_stages // per >= 1):
            ranks = num_stages // per if self.stages_per_rank is not None else max(
                r for r in range(1, num_stages + 1) if num_stages % r == 0 and num_stages // r >= per)
            if ranks != num_ranks:
                options.append(f"{_count(num_stages, 'stage')} on {_count(ranks, 'rank')}")
        others = [name for name, spec in ORDERS.items() if spec.fits(num_stages, num_ranks)]
        if others:
            options.append(f"another schedule: {', '.join(others)}")
        return "; or ".join(options)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _spec(name: str, module: ModuleType) -> OrderSpec:
    """A family's entry, from what its module states as data (``PLACEMENT``, ``STAGES_PER_RANK``, ...)."""
    return OrderSpec(
        name=name,
        compute_order=module.compute_order,
        placement=module.PLACEMENT,
        stages_per_rank=module.STAGES_PER_RANK,
        min_stages_per_rank=module.MIN_STAGES_PER_RANK,
        split_backward=module.SPLIT_BACKWARD,
        paper=module.PAPER,
    )


_SPECS = [
    _spec("GPipe", gpipe),
    _spec("1F1B", one_f_one_b),
    _spec("Interleaved1F1B", interleaved_1f1b),
    _spec("LoopedBFS", looped_bfs),
    _spec("InterleavedZeroBubble", interleaved_zero_bubble),
    _spec("ZBVZeroBubble", zbv_zero_bubble),
    _spec("DualPipeV", dualpipe_v),
]

ORDERS: dict[str, OrderSpec] = {spec.name: spec for spec in _SPECS}


def get_order_spec(name: str) -> OrderSpec:
    """Look up a family by name, case-insensitively, with or without the schedule class's
    ``Schedule`` prefix: the one lookup of schedule names (``get_schedule_class`` uses it).

    Raises:
        ValueError: for an unknown name, listing the valid ones.

    Example:
        >>> get_order_spec("ScheduleZBVZeroBubble").name
        'ZBVZeroBubble'
    """
    by_lower = {key.lower(): spec for key, spec in ORDERS.items()}
    spec = by_lower.get(name.lower().removeprefix("schedule"))
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(ORDERS)}")
    return spec
