"""The batch rule's event loop: every rank of a lowered order run together, as NCCL runs it.

Sits under :mod:`.simulate` (which times a lowered order with it) and :mod:`.validate`
(which dry-runs one with zero costs to prove it cannot deadlock), above :mod:`.messages`.
The rule (see :mod:`.actions`): a rank posts a batch (a maximal run of comm actions) once
it reaches it and its previous batch has completed; a batch completes once every message
in it has its counterpart posted (plus a latency); a compute action waits only for the
batches that receive what it consumes. The compute-only loop is :mod:`.event_loop`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .actions import Action, ActionKind, Order
from .messages import Message, Peers, action_messages

__all__ = ["BatchRun", "run_batches"]

F, B, I = ActionKind.F, ActionKind.B, ActionKind.I


@dataclass
class BatchRun:
    """How far every rank got under the batch rule (see :func:`run_batches`)."""

    timeline: dict[int, list[tuple[float, float, Action]]]
    """Per rank, ``(start, end, action)`` of what ran."""
    ptr: dict[int, int]
    """Per rank, the step it stopped at (``len`` of its list when it finished)."""
    blocked: dict[int, tuple[Message, bool]]
    """Per stuck rank, the message side it waits for: ``(message, posted by its sender?)``."""
    posts: dict[tuple[int, int], list[Message]]
    """``(rank, step) -> messages`` each comm action posts, in posting order."""

    def stuck(self) -> dict[int, tuple[int, tuple[Message, bool]]]:
        """``{rank: (step, (message, by its sender?))}`` of every stuck rank, as
        :func:`~pippy_split.schedule.errors.deadlock_message` reads it."""
        return {r: (self.ptr[r], self.blocked[r]) for r in self.blocked}


def run_batches(order: Order, table: Mapping[int, Peers],
                cost: Mapping[ActionKind, float] | Callable[[int, ActionKind], float] | None = None,
                latency: float | Callable[[int, int], float] = 0.0,
                scale: Sequence[float] | None = None, prefill: Callable[[int], float] | None = None) -> BatchRun:
    """Run a lowered order under NCCL's batch rule, the one event loop that ``simulate``
    (times) and ``validate`` (deadlocks) share: a rank posts a batch once it reaches it
    and its previous batch completed; a batch completes once every message in it has its
    counterpart posted (plus ``latency``); a compute action waits only for the batches
    that receive what it consumes. Ranks that can never go on are left in ``blocked``.
    ``cost`` is per kind or ``f(stage, kind)``; ``latency`` one number or
    ``f(src_stage, dst_stage)`` per message; ``scale[mb]`` multiplies both for microbatch ``mb``;
    ``prefill(stage)``, where given, prices a decode order's round 0 (``D`` at round 0) instead of ``cost``.

    Raises:
        ValueError: a comm action names a peer it does not exchange with (from
            :func:`~pippy_split.schedule.messages.action_messages`).
    """
    if not callable(cost):
        by_kind = dict(cost or {})
        cost = lambda stage, kind: by_kind.get(kind, 0.0)  # noqa: E731
    lat = latency if callable(latency) else (lambda src, dst, value=float(latency): value)
    loop = _BatchLoop(order, table, cost, lat, scale, _decode_inputs(order), prefill)
    queue = deque(sorted(order))
    while queue:
        queue.extend(loop.advance(queue.popleft()))
    return BatchRun(loop.timeline, loop.ptr, loop.blocked, loop.posts)


Op = tuple[Message, bool]  # a message and which end posts it (True: its sender)


class _BatchLoop:
    """The state of :func:`run_batches`: per rank, how far it got and when it is free."""

    def __init__(self, order: Order, table: Mapping[int, Peers], cost: Callable[[int, ActionKind], float],
                 lat: Callable[[int, int], float], scale: Sequence[float] | None = None,
                 decode_inputs: Mapping[tuple[int, int, int], list[Message]] | None = None,
                 prefill: Callable[[int], float] | None = None) -> None:
        self.order, self.table, self.cost, self.lat = order, table, cost, lat
        self.prefill = prefill
        self.decode_inputs = decode_inputs or {}
        self.scale = scale
        self.posted: dict[Op, float] = {}  # -> time posted
        self.waiting: dict[Op, list[int]] = {}  # ranks waiting for an op to be posted
        self.arrival: dict[Message, float] = {}  # completion time of the batch that receives it
        self.posts: dict[tuple[int, int], list[Message]] = {}
        self.ptr = {r: 0 for r in order}
        self.free = {r: 0.0 for r in order}  # when the rank's compute is free
        self.stream = {r: 0.0 for r in order}  # when the rank's previous batch completed
        self.timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in order}
        self.blocked: dict[int, Op] = {}

    def advance(self, rank: int) -> list[int]:
        """Run ``rank`` until it ends or waits for a counterpart; the ranks its posts woke."""
        acts, pos = self.order[rank], self.ptr[rank]
        woken: list[int] = []
        self.blocked.pop(rank, None)
        while pos < len(acts):
            a = acts[pos]
            if a is None or a.kind.is_compute:
                if a is not None:
                    self._compute(rank, a)
                pos += 1
                continue
            end, ops = self._batch(rank, pos)
            t_post = max(self.free[rank], self.stream[rank])
            for op in ops:
                if op not in self.posted:
                    self.posted[op] = t_post
                    woken.extend(self.waiting.pop(op, ()))
            missing = next(((m, not side) for m, side in ops if (m, not side) not in self.posted), None)
            if missing is not None:
                self.waiting.setdefault(missing, []).append(rank)
                self.blocked[rank] = missing
                break
            self._complete(rank, ops, t_post, [x for x in acts[pos:end] if x is not None])
            pos = end
        self.ptr[rank] = pos
        return woken

    def _compute(self, rank: int, a: Action) -> None:
        start = self.free[rank]
        consumed = (self.decode_inputs.get((a.stage, a.mb, a.round), []) if a.round is not None
                    else _consumed(a, self.table))
        for m in consumed:
            start = max(start, self.arrival.get(m, start))
        cost = self.prefill(a.stage) if self.prefill is not None and a.round == 0 else self.cost(a.stage, a.kind)
        self.free[rank] = start + cost * (1.0 if self.scale is None else self.scale[a.mb])
        self.timeline[rank].append((start, self.free[rank], a))

    def _batch(self, rank: int, pos: int) -> tuple[int, list[Op]]:
        """The batch starting at ``pos``: where it ends and the ops it posts."""
        acts, end = self.order[rank], pos
        ops: list[Op] = []
        while end < len(acts):
            a = acts[end]
            if a is not None and not a.kind.is_comm:
                break
            if a is not None:
                msgs = self.posts.get((rank, end))
                if msgs is None:
                    msgs = self.posts[(rank, end)] = action_messages(a, self.table)
                ops += [(m, a.is_send) for m in msgs]
            end += 1
        return end, ops

    def _complete(self, rank: int, ops: list[Op], t_post: float, comms: list[Action]) -> None:
        f = (lambda mb: 1.0) if self.scale is None else self.scale.__getitem__
        done = max((max(t_post, self.posted[(m, not side)]) + self.lat(m.sender, m.receiver) * f(m.mb)
                    for m, side in ops),
                   default=t_post + self.lat(-1, -1))
        for m, side in ops:
            if not side:
                self.arrival[m] = done
        self.stream[rank] = done
        self.timeline[rank].extend((t_post, t_post, a) for a in comms)


def _decode_inputs(order: Order) -> dict[tuple[int, int, int], list[Message]]:
    """A decode program's compute ``D(s, lane, t)`` reads the messages its rank receives for
    stage ``s``, lane and round ``t`` (values, and the tokens chosen at ``t - 1``): read off the
    order's receives, as a decode order names every message's stage and round."""
    out: dict[tuple[int, int, int], list[Message]] = {}
    for actions in order.values():
        for a in actions:
            if a is not None and a.round is not None and a.kind.is_comm and not a.is_send:
                assert a.peer is not None
                direction = "T" if a.kind is ActionKind.RECV_T else "D"
                out.setdefault((a.stage, a.mb, a.round), []).append(Message(direction, a.peer, a.stage, a.mb, a.round))
    return out


def _consumed(a: Action, table: Mapping[int, Peers]) -> list[Message]:
    """Remote messages compute action ``a`` reads: activations for F, gradients for B/I."""
    peers = table[a.stage]
    if a.kind is F:
        return [Message("F", src, a.stage, a.mb) for src in peers.recv_f]
    if a.kind is B or a.kind is I:
        return [Message("B", dst, a.stage, a.mb) for dst in peers.recv_b]
    return []
