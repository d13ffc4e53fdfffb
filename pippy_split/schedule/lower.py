"""Lowering: turn a compute-only order into one the runtime can execute.

Sits between the order generators (``orders/``, which emit F, B, I, W per rank)
and the runtime. Every pass here is a plain list-to-list function on an
:data:`~pippy_split.schedule.actions.Order`:

* :func:`lower` adds ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` from the link
  table and the placement, NCCL-safe by construction: a ``SEND`` goes into the
  batch right after the action that produces it, its ``RECV`` into the
  receiver's batch at the moment of sending (in a simulation of all ranks), so
  every channel carries its messages in one order at both ends. Stages on the
  same rank hand values over in memory, so a pair of them gets no
  communication at all.
* :func:`merge_backward` / :func:`split_backward` convert between ``I`` + ``W``
  and a fused ``B``.

Directions, for a link ``(src, dst, carries_grad)`` whose ends sit on
different ranks: ``src`` sends its forward output (``SEND_F`` after ``F``),
``dst`` receives it (``RECV_F`` before ``F``); when the link carries a
gradient, ``dst`` sends the input gradient back (``SEND_B`` after ``B``/``I``)
and ``src`` receives it (``RECV_B`` before ``B``/``I``). One ``SEND``/``RECV``
action moves one message (one stage to one stage; the runtime moves one tensor
per edge between them).
"""

from __future__ import annotations

import heapq
from typing import Iterable, Mapping

from .actions import Action, ActionKind, Order
from .deps import DepIndex, Link, chain_links
from .errors import ScheduleError
from .messages import Message, Peers, peer_table, peers, recv_action, send_action
from .placement import placement_of_order, resolve_placement
from .validate import validate

infer_placement = placement_of_order  # the one rule, in placement.py; kept under its lowering-era name

__all__ = [
    "Peers",
    "peers",
    "peer_table",
    "infer_placement",
    "lower",
    "merge_backward",
    "split_backward",
]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B


def lower(
    order: Order,
    links: Iterable[Link] | None = None,
    placement: Mapping[int, int] | str | None = None,
    costs: Mapping[str, float] | None = None,
) -> Order:
    """Add communication actions to a compute-only order, NCCL-safe by construction.

    All ranks are simulated together (``costs`` per compute kind, default 1
    each, ``B`` = ``I`` + ``W``). When a compute action ends, the messages it
    owes go into the batch right after it, and each message's receive goes into
    the receiver's batch at the point the receiver has reached at that moment
    (hoisted above the action that will consume it, if need be). Both ends of
    every channel therefore list its messages in the same order, and the batch
    that receives a message is posted no later than the receiver needed it. Each
    batch is written sorted by peer rank, then by the message's place on its
    channel (see :mod:`.actions` for the batch rule).

    Args:
        order: ``{rank: [Action | None, ...]}`` of compute actions (F, B, I, W).
        links: ``(src_stage, dst_stage, carries_grad)`` triples; default the chain
            ``s -> s + 1`` over every stage the order (and placement) names.
        placement: ``{stage: rank}`` (or ``"loop"``/``"v"``); default: inferred
            from which rank's list holds each stage's actions.
        costs: time per compute kind for the simulation that places the receives.

    Returns:
        A new order, idle ``None`` slots dropped, with SEND/RECV actions added.
        A comm action names its peer stage when its stage has more than one
        remote peer in that direction.

    Raises:
        ScheduleError: the compute order itself cannot run (see ``validate``).

    Example:
        >>> order = {0: [Action(0, F, 0), None, Action(0, B, 0)],
        ...          1: [None, Action(1, F, 0), Action(1, B, 0)]}
        >>> [str(a) for a in lower(order)[1]]
        ['1RECV_F0', '1F0', '1B0', '1SEND_B0']
    """
    link_list = chain_links(_num_stages(order, placement, [])) if links is None else list(links)
    num_stages = _num_stages(order, placement, link_list)
    where = resolve_placement(placement, num_stages, len(order), order)
    missing = sorted(set(range(num_stages)) - set(where))
    if missing:
        raise ValueError(f"no rank for stages {missing}: pass placement= or give them actions")
    table = peer_table(num_stages, link_list, where)
    for rank in sorted(order):
        for a in order[rank]:
            if a is not None and a.kind.is_comm:
                raise ValueError(f"rank {rank} already has communication action {a}; lower() takes a "
                                 "compute-only order")
    lowered = _Lowering(order, link_list, table, where, costs).run()
    if lowered is None:  # the compute order cannot run: let validate say why
        n_mb = 1 + max((a.mb for acts in order.values() for a in acts if a is not None), default=0)
        validate(order, num_stages, n_mb, links=link_list, placement=where)
        raise ScheduleError("the compute order cannot be run to the end (lowering stalled)")
    return lowered


class _Lowering:
    """One lock-step simulation of every rank that writes the comm actions."""

    def __init__(self, order: Order, links: list[Link], table: dict[int, Peers], where: Mapping[int, int],
                 costs: Mapping[str, float] | None) -> None:
        merged = {"F": 1.0, "I": 1.0, "W": 1.0, **{k: float(v) for k, v in (costs or {}).items()}}
        merged.setdefault("B", merged["I"] + merged["W"])
        self.cost = {F: merged["F"], B: merged["B"], I: merged["I"], W: merged["W"]}
        self.table, self.where = table, where
        self.ranks = sorted(order)
        self.todo = {r: [a for a in order[r] if a is not None] for r in self.ranks}
        self.out: dict[int, list[Action | None]] = {r: [] for r in self.ranks}
        self.batch: dict[int, list[tuple[int, int, Action]]] = {r: [] for r in self.ranks}  # (peer rank, seq, a)
        self.done: set[tuple[int, ActionKind, int]] = set()  # compute (stage, kind, mb) finished
        self.arrived: set[Message] = set()
        self.seq = 0
        # same-rank producers: handed over in memory, so only their completion counts
        index = DepIndex(links, len(table))
        self.local_preds = {s: [p for p in index.preds[s] if where[p] == where[s]] for s in table}
        self.local_grad_succs = {s: [d for d in index.grad_succs[s] if where[d] == where[s]] for s in table}

    def run(self) -> Order | None:
        ptr = {r: 0 for r in self.ranks}
        running: list[tuple[float, int, Action]] = []  # heap of (end time, rank, action)
        busy: set[int] = set()
        now = 0.0
        while True:
            for r in self.ranks:  # start whatever can start now
                if r not in busy and ptr[r] < len(self.todo[r]) and self._ready(self.todo[r][ptr[r]]):
                    a = self.todo[r][ptr[r]]
                    self._flush(r)
                    self.out[r].append(a)
                    ptr[r] += 1
                    busy.add(r)
                    heapq.heappush(running, (now + self.cost[a.kind], r, a))
            if not running:
                break
            now = running[0][0]
            while running and running[0][0] == now:  # every compute ending now, by rank
                _, r, a = heapq.heappop(running)
                busy.discard(r)
                self._finish(r, a)
        for r in self.ranks:
            self._flush(r)
        if any(ptr[r] < len(self.todo[r]) for r in self.ranks):
            return None
        return self.out

    def _ready(self, a: Action) -> bool:
        theirs = self.table[a.stage]
        if a.kind is F:
            return all(Message("F", src, a.stage, a.mb) in self.arrived for src in theirs.recv_f) and all(
                (src, F, a.mb) in self.done for src in self.local_preds.get(a.stage, ()))
        if a.kind is W:
            return (a.stage, I, a.mb) in self.done
        return ((a.stage, F, a.mb) in self.done
                and all(Message("B", dst, a.stage, a.mb) in self.arrived for dst in theirs.recv_b)
                and all((dst, I, a.mb) in self.done for dst in self.local_grad_succs.get(a.stage, ())))

    def _finish(self, rank: int, a: Action) -> None:
        self.done.add((a.stage, a.kind, a.mb))
        if a.kind is B:
            self.done.add((a.stage, I, a.mb))
        theirs = self.table[a.stage]
        if a.kind is F:
            outgoing = [Message("F", a.stage, d, a.mb) for d in theirs.send_f]
            unique_send, unique_recv = len(theirs.send_f) == 1, lambda m: len(self.table[m.receiver].recv_f) == 1
        elif a.kind is B or a.kind is I:
            outgoing = [Message("B", a.stage, src, a.mb) for src in theirs.send_b]
            unique_send, unique_recv = len(theirs.send_b) == 1, lambda m: len(self.table[m.receiver].recv_b) == 1
        else:
            return
        for m in sorted(outgoing, key=lambda m: m.receiver):
            peer_rank = self.where[m.receiver]
            self.batch[rank].append((peer_rank, self.seq, send_action(m, unique_send)))
            self.batch[peer_rank].append((rank, self.seq, recv_action(m, unique_recv(m))))
            self.arrived.add(m)
            self.seq += 1

    def _flush(self, rank: int) -> None:
        pending = self.batch[rank]
        if pending:
            self.out[rank].extend(a for _, _, a in sorted(pending, key=lambda t: (t[0], t[1])))
            pending.clear()


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
