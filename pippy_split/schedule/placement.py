"""Placement: which rank holds which pipeline stage. The one home for it.

Sits between the Pipe (which knows stages, never ranks) and everything that
binds stages to ranks: stage building (``build_schedule``), the order
generators (``orders/``, which state the style they need as data), lowering,
validation and simulation. Nothing else computes a stage's rank.

* ``"loop"``: stage ``s`` lives on rank ``s % p`` (rank 0 holds 0, p, 2p, ...).
* ``"v"``: zig-zag; stages go down the ranks then back up, so with p=4 and
  8 stages rank 0 holds stages 0 and 7, rank 3 holds 3 and 4.
* a ``{stage: rank}`` map: any placement, checked.
* read off an order (:func:`placement_of_order`): the rank whose list holds a
  stage's actions (a stage lives on one rank).

A rank's *chunks* are its stages in ascending order (chunk 0 is its lowest
stage); :func:`replace_placement` keeps each rank's sequence of chunks and
moves it to another style.
"""

from __future__ import annotations

from typing import Literal, Mapping, Union

from .actions import Action, Order
from .errors import PlacementConflict

__all__ = ["Style", "PlacementArg", "stage_to_rank", "rank_to_stages", "local_stages", "placement_of_order",
           "resolve_placement", "replace_placement", "PlacementConflict"]

Style = Literal["loop", "v"]
"""The named placements."""
STYLES: tuple[Style, ...] = ("loop", "v")

PlacementArg = Union[str, Mapping[int, int]]
"""What a ``placement=`` argument may be: a style name or an explicit ``{stage: rank}`` map."""


def stage_to_rank(num_stages: int, num_ranks: int, style: PlacementArg = "loop") -> dict[int, int]:
    """Map every stage to its rank.

    Args:
        num_stages: total pipeline stages.
        num_ranks: ranks in the pipeline group; must divide ``num_stages``.
        style: ``"loop"``, ``"v"``, or an explicit ``{stage: rank}`` map (checked).

    Returns:
        ``{stage: rank}`` for every stage.

    Example:
        >>> stage_to_rank(8, 4, "v")[7]
        0
    """
    if num_ranks < 1 or num_stages < 1:
        raise ValueError(f"need num_stages >= 1 and num_ranks >= 1, got {num_stages} and {num_ranks}")
    if not isinstance(style, str):
        mapping = {int(s): int(r) for s, r in style.items()}
        missing = sorted(set(range(num_stages)) - set(mapping))
        if missing:
            raise ValueError(f"custom placement has no rank for stages {missing}")
        bad = {s: r for s, r in mapping.items() if not 0 <= r < num_ranks}
        if bad:
            raise ValueError(f"custom placement puts stages on ranks outside [0, {num_ranks}): {bad}")
        return mapping
    if num_stages % num_ranks != 0:
        raise ValueError(
            f"{num_stages} stages cannot be spread evenly over {num_ranks} ranks "
            f"(stages must be a multiple of ranks)"
        )
    if style == "loop":
        return {s: s % num_ranks for s in range(num_stages)}
    if style == "v":
        out = {}
        for s in range(num_stages):
            lap, pos = divmod(s, num_ranks)
            out[s] = pos if lap % 2 == 0 else num_ranks - 1 - pos
        return out
    raise ValueError(f"unknown placement style {style!r}: expected 'loop', 'v' or a {{stage: rank}} map")


def rank_to_stages(num_stages: int, num_ranks: int, style: PlacementArg = "loop") -> dict[int, list[int]]:
    """Inverse of :func:`stage_to_rank`: ``{rank: [stages, ascending]}``.

    Example:
        >>> rank_to_stages(8, 4, "v")[0]
        [0, 7]
    """
    out: dict[int, list[int]] = {r: [] for r in range(num_ranks)}
    for s, r in sorted(stage_to_rank(num_stages, num_ranks, style).items()):
        out[r].append(s)
    return out


def local_stages(num_ranks: int, stages_per_rank: int, style: PlacementArg) -> dict[int, list[int]]:
    """``{rank: [chunk 0's stage, chunk 1's stage, ...]}`` for ``num_ranks * stages_per_rank`` stages:
    how an order generator names the stages of a rank.

    Example:
        >>> local_stages(2, 2, "v")
        {0: [0, 3], 1: [1, 2]}
    """
    return rank_to_stages(num_ranks * stages_per_rank, num_ranks, style)


def placement_of_order(order: Order) -> dict[int, int]:
    """``{stage: rank}`` read off an order: the rank whose list holds the stage's actions.

    Entries that are not actions (``None`` idles) are skipped. Stages with no
    action are absent.

    Raises:
        PlacementConflict: a stage has actions on two ranks (names the later one).

    Example:
        >>> from pippy_split.schedule.actions import parse_action
        >>> placement_of_order({0: [parse_action("0F0")], 1: [None, parse_action("1F0")]})
        {0: 0, 1: 1}
    """
    placement: dict[int, int] = {}
    for rank in sorted(order):
        for step, action in enumerate(order[rank]):
            if not isinstance(action, Action):
                continue
            home = placement.setdefault(action.stage, rank)
            if home != rank:
                raise PlacementConflict(action.stage, home, rank, step, action)
    return placement


def resolve_placement(placement: PlacementArg | None, num_stages: int, num_ranks: int,
                      order: Order | None = None) -> dict[int, int]:
    """Turn a ``placement=`` argument into ``{stage: rank}``.

    ``None`` reads it off ``order`` (:func:`placement_of_order`); a style or a map
    goes through :func:`stage_to_rank` (a map must cover every stage).

    Example:
        >>> resolve_placement("v", 4, 2)
        {0: 0, 1: 1, 2: 1, 3: 0}
    """
    if placement is None:
        if order is None:
            raise ValueError("resolve_placement(None, ...) needs the order to read the placement off")
        return placement_of_order(order)
    return stage_to_rank(num_stages, num_ranks, placement)


def replace_placement(order: Order, num_stages: int, num_ranks: int, src: PlacementArg, dst: PlacementArg) -> Order:
    """The same per-rank sequence of stage *chunks* (first, second, ... stage a rank holds)
    under another placement: with p=4, loop's stage 5 (rank 1, chunk 1) becomes V's stage 6.

    Example:
        >>> from pippy_split.schedule.actions import parse_action
        >>> moved = replace_placement({0: [parse_action("2F0")], 1: []}, 4, 2, "loop", "v")
        >>> str(moved[0][0])
        '3F0'
    """
    src_stages = rank_to_stages(num_stages, num_ranks, src)
    dst_stages = rank_to_stages(num_stages, num_ranks, dst)
    if any(len(src_stages[r]) != len(dst_stages[r]) for r in range(num_ranks)):
        raise ValueError(f"cannot move an order from placement {src!r} to {dst!r}: the ranks hold different "
                         "numbers of stages under them")
    mapping = {s: dst_stages[r][c] for r, stages in src_stages.items() for c, s in enumerate(stages)}
    return {r: [None if a is None else Action(mapping[a.stage], a.kind, a.mb) for a in acts]
            for r, acts in order.items()}
