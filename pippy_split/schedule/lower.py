"""Lowering: turn a compute-only order into one the runtime can execute.

Sits between the order generators (``orders/``, which emit F, B, I, W per rank)
and the runtime. Every pass here is a plain list-to-list function on an
:data:`~pippy_split.schedule.actions.Order`:

* :func:`lower` adds ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` from the link
  table and the placement. A ``RECV`` sits immediately before the action that
  consumes it (never hoisted), a ``SEND`` immediately after the action that
  produces it. Stages on the same rank hand values over in memory, so a pair
  of them gets no communication at all.
* :func:`merge_backward` / :func:`split_backward` convert between ``I`` + ``W``
  and a fused ``B``.

Directions, for a link ``(src, dst, carries_grad)`` whose ends sit on
different ranks: ``src`` sends its forward output (``SEND_F`` after ``F``),
``dst`` receives it (``RECV_F`` before ``F``); when the link carries a
gradient, ``dst`` sends the input gradient back (``SEND_B`` after ``B``/``I``)
and ``src`` receives it (``RECV_B`` before ``B``/``I``). One ``SEND``/``RECV``
action covers every remote peer of that stage in that direction; the runtime
moves one tensor per edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .actions import Action, ActionKind, Order
from .deps import Link, chain_links
from .placement import stage_to_rank

__all__ = [
    "Peers",
    "peers",
    "peer_table",
    "infer_placement",
    "resolve_placement",
    "lower",
    "merge_backward",
    "split_backward",
]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B


@dataclass(frozen=True)
class Peers:
    """The stages on *other* ranks that one stage exchanges tensors with.

    Same-rank stages are left out: they hand values over in memory.
    """

    recv_f: tuple[int, ...] = ()
    """Stages whose forward outputs this stage receives (links into it)."""
    send_f: tuple[int, ...] = ()
    """Stages this stage sends its forward outputs to (links out of it)."""
    recv_b: tuple[int, ...] = ()
    """Stages whose input gradients this stage receives (grad links out of it)."""
    send_b: tuple[int, ...] = ()
    """Stages this stage sends its input gradients to (grad links into it)."""


def peer_table(num_stages: int, links: Iterable[Link], placement: Mapping[int, int]) -> dict[int, Peers]:
    """:class:`Peers` of every stage, indexing ``links`` once.

    Args:
        num_stages: total pipeline stages.
        links: ``(src_stage, dst_stage, carries_grad)`` triples.
        placement: ``{stage: rank}`` for every stage.

    Returns:
        ``{stage: Peers}`` for every stage in ``range(num_stages)``.

    Example:
        >>> peer_table(3, [(0, 1, True), (1, 2, True), (0, 2, False)], {0: 0, 1: 1, 2: 0})[0]
        Peers(recv_f=(), send_f=(1,), recv_b=(1,), send_b=())
    """
    table: dict[int, dict[str, list[int]]] = {
        s: {"recv_f": [], "send_f": [], "recv_b": [], "send_b": []} for s in range(num_stages)
    }
    for src, dst, carries_grad in links:
        if not (0 <= src < num_stages and 0 <= dst < num_stages):
            raise ValueError(f"link ({src} -> {dst}) names a stage outside [0, {num_stages})")
        if placement[src] == placement[dst]:
            continue  # local hand-off, no communication
        _add(table[src]["send_f"], dst)
        _add(table[dst]["recv_f"], src)
        if carries_grad:
            _add(table[dst]["send_b"], src)
            _add(table[src]["recv_b"], dst)
    return {s: Peers(**{k: tuple(v) for k, v in d.items()}) for s, d in table.items()}


def _add(bucket: list[int], stage: int) -> None:
    if stage not in bucket:
        bucket.append(stage)


def peers(stage: int, links: Iterable[Link], placement: Mapping[int, int]) -> Peers:
    """:class:`Peers` of one stage (see :func:`peer_table` for all at once).

    Example:
        >>> peers(1, [(0, 1, True), (1, 2, True)], {0: 0, 1: 1, 2: 1}).recv_f
        (0,)
    """
    links = list(links)
    num_stages = max([stage, *placement, *(max(s, d) for s, d, _ in links)]) + 1
    return peer_table(num_stages, links, placement)[stage]


def infer_placement(order: Order) -> dict[int, int]:
    """``{stage: rank}`` read off an order: the rank whose list holds the stage.

    Raises:
        ValueError: a stage has actions on two ranks.
    """
    placement: dict[int, int] = {}
    for rank in sorted(order):
        for action in order[rank]:
            if action is None:
                continue
            home = placement.setdefault(action.stage, rank)
            if home != rank:
                raise ValueError(
                    f"stage {action.stage} has actions on rank {home} and rank {rank} "
                    f"(first seen: {action} on rank {rank}); a stage lives on one rank"
                )
    return placement


def resolve_placement(
    order: Order, num_stages: int, placement: Mapping[int, int] | str | None
) -> dict[int, int]:
    """Turn the ``placement`` argument of :func:`lower`/``validate`` into ``{stage: rank}``.

    ``None`` infers it from ``order``; a string (``"loop"``, ``"v"``) goes through
    :func:`~pippy_split.schedule.placement.stage_to_rank` with ``len(order)`` ranks.
    """
    if placement is None:
        return infer_placement(order)
    if isinstance(placement, str):
        return stage_to_rank(num_stages, len(order), placement)
    return {int(s): int(r) for s, r in placement.items()}


def lower(
    order: Order,
    links: Iterable[Link] | None = None,
    placement: Mapping[int, int] | str | None = None,
) -> Order:
    """Add communication actions to a compute-only order.

    Args:
        order: ``{rank: [Action | None, ...]}`` of compute actions (F, B, I, W).
        links: ``(src_stage, dst_stage, carries_grad)`` triples; default the chain
            ``s -> s + 1`` over every stage the order (and placement) names.
        placement: ``{stage: rank}`` (or ``"loop"``/``"v"``); default: inferred
            from which rank's list holds each stage's actions.

    Returns:
        A new order, idle ``None`` slots dropped, each compute action wrapped by
        the ``RECV_*`` it needs just before it and the ``SEND_*`` it owes just
        after it.

    Example:
        >>> order = {0: [Action(0, F, 0), None, Action(0, B, 0)],
        ...          1: [None, Action(1, F, 0), Action(1, B, 0)]}
        >>> [str(a) for a in lower(order)[1]]
        ['1RECV_F0', '1F0', '1B0', '1SEND_B0']
    """
    link_list = None if links is None else list(links)
    num_stages = _num_stages(order, placement, link_list or [])
    where = resolve_placement(order, num_stages, placement)
    missing = sorted(set(range(num_stages)) - set(where))
    if missing:
        raise ValueError(f"no rank for stages {missing}: pass placement= or give them actions")
    table = peer_table(num_stages, chain_links(num_stages) if link_list is None else link_list, where)
    return {rank: _lower_rank(rank, order[rank], table) for rank in sorted(order)}


def _lower_rank(rank: int, actions: list[Action | None], table: dict[int, Peers]) -> list[Action | None]:
    """One rank's list with its RECVs and SENDs in place, idle slots dropped."""
    out: list[Action | None] = []
    append = out.append
    for a in actions:
        if a is None:
            continue
        kind, peers_of = a.kind, table[a.stage]
        if kind is F:
            if peers_of.recv_f:
                append(Action(a.stage, RECV_F, a.mb))
            append(a)
            if peers_of.send_f:
                append(Action(a.stage, SEND_F, a.mb))
        elif kind is B or kind is I:
            if peers_of.recv_b:
                append(Action(a.stage, RECV_B, a.mb))
            append(a)
            if peers_of.send_b:
                append(Action(a.stage, SEND_B, a.mb))
        elif kind is W:  # nothing crosses ranks
            append(a)
        else:
            raise ValueError(f"rank {rank} already has communication action {a}; lower() takes a compute-only order")
    return out


def _num_stages(order: Order, placement: Mapping[int, int] | str | None, links: list[Link]) -> int:
    stages = {a.stage for actions in order.values() for a in actions if a is not None}
    stages |= {s for link in links for s in link[:2]}
    if placement is not None and not isinstance(placement, str):
        stages |= set(placement)
    return max(stages, default=-1) + 1


def merge_backward(order: Order) -> Order:
    """Fuse ``I(s, mb)`` immediately followed by ``W(s, mb)`` into one ``B(s, mb)``.

    Other ``I``/``W`` (split apart by anything, including an idle slot) are kept.

    Example:
        >>> merge_backward({0: [Action(0, F, 0), Action(0, I, 0), Action(0, W, 0)]})[0]
        [Action(0F0), Action(0B0)]
    """
    merged: Order = {}
    for rank, actions in order.items():
        out: list[Action | None] = []
        i = 0
        while i < len(actions):
            a = actions[i]
            nxt = actions[i + 1] if i + 1 < len(actions) else None
            if (
                a is not None
                and nxt is not None
                and a.kind is I
                and nxt.kind is W
                and (a.stage, a.mb) == (nxt.stage, nxt.mb)
            ):
                out.append(Action(a.stage, B, a.mb))
                i += 2
                continue
            out.append(a)
            i += 1
        merged[rank] = out
    return merged


def split_backward(order: Order) -> Order:
    """Replace every ``B(s, mb)`` by ``I(s, mb)`` with ``W(s, mb)`` right after it.

    Example:
        >>> split_backward({0: [Action(0, F, 0), Action(0, B, 0)]})[0]
        [Action(0F0), Action(0I0), Action(0W0)]
    """
    split: Order = {}
    for rank, actions in order.items():
        out: list[Action | None] = []
        for a in actions:
            if a is not None and a.kind is B:
                out += [Action(a.stage, I, a.mb), Action(a.stage, W, a.mb)]
            else:
                out.append(a)
        split[rank] = out
    return split
