"""The decode order as data: per rank, actions over (stage, lane, round) (schedule layer, pure).

Like a training order, it is built without tensors or process groups, lowered (messages
added), validated and simulated by plain functions:

* :func:`decode_order`: the compute actions. ``D(s, l, t)`` runs stage ``s`` for lane ``l``
  at round ``t`` (round 0 the prefill, then one token per round). Stage ``s`` needs stage
  ``s - 1``'s values of the same lane and round; stage 0 at round ``t`` needs the tokens the
  last stage chose at round ``t - 1``. Each rank runs, at each moment, the ready action of
  the lowest ``(round, lane, stage)``, found by running all ranks together with unit costs:
  every stage then handles lanes in the same order, so every channel carries its messages
  in one order at both ends.
* :func:`lower_decode`: adds ``SEND``/``RECV`` (``h``: the values of the stage's edges;
  ``t``: the new tokens, from the last stage to each stage that reads ``input_ids``). A
  compute's sends and the next compute's receives form one batch, as NCCL needs.
* :func:`validate_decode`: every compute once, on its stage's rank; on every directed channel
  the sends and receives name the same messages in the same order; and all ranks run to
  the end under NCCL's batch rule (a batch completes once each op's counterpart is
  posted), else a :class:`DecodeOrderError` naming rank and step.
* :func:`simulate_decode`: makespan and each rank's busy fraction with given costs.

Example (2 stages on 2 ranks, 2 lanes, 2 rounds)::

    >>> order = decode_order({0: 0, 1: 1}, lanes=2, rounds=2)
    >>> [str(a) for a in order[0]]
    ['0D0.0', '0D1.0', '0D0.1', '0D1.1']
    >>> lowered = lower_decode(order, {0: 0, 1: 1}, links={1: {0}}, token_readers={0})
    >>> validate_decode(lowered, {0: 0, 1: 1}, lanes=2, rounds=2)
    >>> round(simulate_decode(lowered).bubble_fraction, 2)
    0.2
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["DecodeOrderError", "DecodeAction", "DecodeOrder", "decode_order", "lower_decode", "validate_decode", "simulate_decode",
           "DecodeSimulation", "content_round", "decision_lag", "is_decode_order"]


class DecodeOrderError(ValueError):
    """A decode order that is incomplete, mis-ordered or would deadlock (the message names the
    rank and step)."""


@dataclass(frozen=True, order=True)
class DecodeAction:
    """One action of a decode order. ``kind``: ``"D"`` (compute), ``"SEND"`` or ``"RECV"``;
    ``stage`` is this rank's stage, ``peer`` the other end's (comm only), ``what`` ``"h"``
    (stage values) or ``"t"`` (tokens)."""

    kind: str
    stage: int
    lane: int
    round: int
    peer: int = -1
    what: str = "h"

    def __str__(self) -> str:
        if self.kind == "D":
            return f"{self.stage}D{self.lane}.{self.round}"
        arrow = ">" if self.kind == "SEND" else "<"
        return f"{self.stage}{self.kind}_{self.what}{self.lane}.{self.round}{arrow}{self.peer}"

    @property
    def message(self) -> tuple[int, int, int, int, str]:
        """``(src stage, dst stage, lane, round, what)``: the same for a send and its receive."""
        if self.kind == "SEND":
            return (self.stage, self.peer, self.lane, self.round, self.what)
        return (self.peer, self.stage, self.lane, self.round, self.what)


DecodeOrder = dict[int, list[DecodeAction]]


def decode_order(placement: dict[int, int], *, lanes: int, rounds: int) -> DecodeOrder:
    """The compute actions of ``rounds`` rounds of ``lanes`` lanes over the stages of
    ``placement`` (``{stage: rank}``); see the module docstring."""
    if lanes < 1 or rounds < 0:
        raise DecodeOrderError(f"a decode order needs lanes >= 1 and rounds >= 0, got {lanes}, {rounds}")
    stages = sorted(placement)
    last = stages[-1]
    ranks = sorted(set(placement.values()))
    order: DecodeOrder = {r: [] for r in ranks}
    ready: dict[int, list[tuple[int, int, int]]] = {r: [] for r in ranks}  # heap of (round, lane, stage)
    if rounds:
        for lane in range(lanes):
            heapq.heappush(ready[placement[stages[0]]], (0, lane, stages[0]))
    # A task enters its rank's heap when the task it waits for has finished (unit costs: at the
    # next tick), so every task in a heap can start; each rank starts its lowest one per tick.
    while any(ready.values()):
        started = [heapq.heappop(ready[r]) for r in ranks if ready[r]]
        for t, lane, s in started:
            order[placement[s]].append(DecodeAction("D", s, lane, t))
            if s != last:
                nxt = stages[stages.index(s) + 1]
                heapq.heappush(ready[placement[nxt]], (t, lane, nxt))
            elif t + 1 < rounds:
                heapq.heappush(ready[placement[stages[0]]], (t + 1, lane, stages[0]))
    return order


def lower_decode(order: DecodeOrder, placement: dict[int, int], *, links: dict[int, set[int]],
                 token_readers: set[int]) -> DecodeOrder:
    """``order`` with its messages: after ``D(s, l, t)`` a send to each stage on another rank
    that reads ``s`` (``links[d]`` holds ``s``), and from the last stage the tokens for round
    ``t + 1`` to each rank that holds a stage of ``token_readers`` (once per rank, to its
    lowest such stage); before a compute, the receives it needs. A channel (one rank to
    another) may carry several stages' messages: its receives keep its send order (a message
    needed later may be received early, and kept)."""
    stages = sorted(placement)
    last = stages[-1]
    rounds = 1 + max((a.round for acts in order.values() for a in acts), default=-1)
    readers_of: dict[int, list[int]] = {p: sorted(s for s, srcs in links.items() if p in srcs) for p in stages}
    token_to: dict[int, int] = {}
    for s in sorted(token_readers, reverse=True):
        token_to[placement[s]] = s
    sends: dict[int, list[list[DecodeAction]]] = {}  # rank -> the sends after each of its computes
    channel: dict[tuple[int, int], list[DecodeAction]] = {}  # (src rank, dst rank) -> sends in order
    for r, actions in order.items():
        sends[r] = []
        for a in actions:
            s, lane, t = a.stage, a.lane, a.round
            out = [DecodeAction("SEND", s, lane, t, d, "h") for d in readers_of[s] if placement[d] != r]
            if s == last and t + 1 < rounds:
                out += [DecodeAction("SEND", s, lane, t + 1, d, "t") for q, d in sorted(token_to.items()) if q != r]
            sends[r].append(out)
            for m in out:
                channel.setdefault((r, placement[m.peer]), []).append(m)
    ticks = _start_ticks(order, placement)
    # Each receive goes in the first gap between computes of its rank that comes once its send
    # has happened (in the unit-cost run the order was built from): a value travelling far (a
    # skip edge, the tokens) is received when it is sent, not when it is used, so no send waits
    # on a receiver busy with messages that depend on it. A channel's receives keep its order.
    gaps: dict[int, dict[int, list[tuple[int, int, DecodeAction]]]] = {r: {} for r in order}
    for (src, dst), msgs in channel.items():
        for k, m in enumerate(msgs):
            sent = ticks[(m.stage, m.lane, m.round - (1 if m.what == "t" else 0))] + 1
            gap = next(i for i, a in enumerate(order[dst]) if ticks[(a.stage, a.lane, a.round)] >= sent)
            gaps[dst].setdefault(gap, []).append((src, k, DecodeAction("RECV", m.peer, m.lane, m.round, m.stage,
                                                                          m.what)))
    lowered: DecodeOrder = {}
    for r, actions in order.items():
        out_r: list[DecodeAction] = []
        for i, (a, after) in enumerate(zip(actions, sends[r])):
            out_r.extend(recv for _, _, recv in sorted(gaps[r].get(i, []), key=lambda x: (x[0], x[1])))
            out_r.append(a)
            out_r.extend(after)
        lowered[r] = out_r
    return lowered


def content_round(a: DecodeAction) -> int:
    """The round whose work ``a`` belongs to: its own, or for tokens the round that chose them
    (the tokens labelled ``t`` are round ``t - 1``'s)."""
    return a.round - 1 if a.what == "t" else a.round


def decision_lag(lowered: DecodeOrder, placement: dict[int, int]) -> int:
    """The fewest rounds ``k >= 1`` such that, on every rank, every action of a lane's round
    ``t + k`` or later comes in a batch after the one where that rank learns the lane's tokens
    of round ``t`` (its last stage's compute, or the tokens' receive).

    A lane whose rows are all done after round ``t`` can then stop at round ``t + k`` on every
    rank at once: each rank decides from the tokens before it posts any action it skips, so
    both ends of every message skip it together (the rounds between run idle).

    Example:
        >>> placement = {0: 0, 1: 1}
        >>> lowered = lower_decode(decode_order(placement, lanes=2, rounds=4), placement, links={1: {0}},
        ...                        token_readers={0})
        >>> decision_lag(lowered, placement)
        1
    """
    last = max(placement)
    lag = 1
    for r, actions in lowered.items():
        known: dict[tuple[int, int], int] = {}  # (lane, round) -> batch where its tokens are known here
        latest: dict[tuple[int, int], int] = {}  # (lane, round) -> last batch index holding an action of it
        for b, batch in enumerate(_batches(actions)):
            for a in batch:
                if (a.kind == "D" and a.stage == last) or (a.kind == "RECV" and a.what == "t"):
                    known.setdefault((a.lane, content_round(a)), b)
                latest[(a.lane, content_round(a))] = b
        first: dict[tuple[int, int], int] = {}
        for b, batch in enumerate(_batches(actions)):
            for a in batch:
                first.setdefault((a.lane, content_round(a)), b)
        for (lane, u), b in first.items():
            # every earlier round t whose tokens are known only at or after batch b forces k > u - t
            for t in range(u - 1, -1, -1):
                at = known.get((lane, t))
                if at is None:
                    if (lane, t) in latest:
                        raise DecodeOrderError(f"decode order: rank {r} never learns lane {lane}'s tokens of round "
                                              f"{t} but runs its round {u}")
                    continue
                if at >= b:
                    lag = max(lag, u - t + 1)
                else:
                    break
    return lag


def _start_ticks(order: DecodeOrder, placement: dict[int, int]) -> dict[tuple[int, int, int], int]:
    """Each compute's start in a unit-cost run of the compute-only ``order`` (as soon as its
    rank is free and the stage before it, or the last stage's previous round, has finished)."""
    stages = sorted(placement)
    first, last = stages[0], stages[-1]

    def needs(a: DecodeAction) -> tuple | None:
        if a.stage != first:
            return (stages[stages.index(a.stage) - 1], a.lane, a.round)
        return (last, a.lane, a.round - 1) if a.round > 0 else None

    starts, _, _ = _play(order, 1.0, needs, "decode order: a compute waits for one that never runs")
    return {k: int(v) for k, v in starts.items()}


def _play(order: DecodeOrder, cost: float, needs: Callable[[DecodeAction], tuple | None], stuck: str
          ) -> tuple[dict[tuple[int, int, int], float], dict[int, float], dict[int, float]]:
    """Every rank runs its actions in order; an action waits until its rank is free and what
    ``needs`` names has happened (a compute's key ``(stage, lane, round)``: it has finished; a
    message: it was sent). Computes take ``cost``, messages none. Returns each compute's
    start, each rank's end and busy time; raises ``DecodeOrderError(stuck)`` if no rank can move."""
    done: dict[tuple, float] = {}
    starts: dict[tuple[int, int, int], float] = {}
    clock = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}
    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                key = needs(a)
                if key is not None and key not in done:
                    break
                ready = done[key] if key is not None else 0.0
                if a.kind == "D":
                    begin = max(clock[r], ready)
                    starts[(a.stage, a.lane, a.round)] = begin
                    clock[r] = done[(a.stage, a.lane, a.round)] = begin + cost
                    busy[r] += cost
                elif a.kind == "RECV":
                    clock[r] = max(clock[r], ready)
                else:
                    done[a.message] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise DecodeOrderError(stuck)
    return starts, clock, busy


def _batches(actions: list[DecodeAction]) -> list[list[DecodeAction]]:
    """Each compute alone, each maximal run of comm actions as one batch."""
    out: list[list[DecodeAction]] = []
    for a in actions:
        if a.kind != "D" and out and out[-1][0].kind != "D":
            out[-1].append(a)
        else:
            out.append([a])
    return out


def validate_decode(lowered: DecodeOrder, placement: dict[int, int], *, lanes: int, rounds: int) -> None:
    """Raise :class:`DecodeOrderError` naming the rank and step where ``lowered`` is wrong."""
    want = {("D", s, lane, t) for s in placement for lane in range(lanes) for t in range(rounds)}
    seen: set[tuple[str, int, int, int]] = set()
    for r, actions in lowered.items():
        for step, a in enumerate(actions):
            if a.kind == "D":
                key = ("D", a.stage, a.lane, a.round)
                if placement.get(a.stage) != r or key in seen or key not in want:
                    raise DecodeOrderError(f"decode order: rank {r} step {step}: {a} is misplaced, repeated or "
                                          "out of range")
                seen.add(key)
    if seen != want:
        missing = sorted(want - seen)[:3]
        raise DecodeOrderError(f"decode order: computes missing, e.g. {missing}")
    channels: dict[tuple[int, int, str], list] = {}
    for r, actions in lowered.items():
        for a in actions:
            if a.kind != "D":
                src, dst = (r, placement[a.peer]) if a.kind == "SEND" else (placement[a.peer], r)
                channels.setdefault((src, dst, a.kind), []).append(a.message)
    for (src, dst, kind), msgs in channels.items():
        if kind == "SEND" and channels.get((src, dst, "RECV"), []) != msgs:
            raise DecodeOrderError(f"decode order: rank {src} sends to rank {dst} in another order than rank "
                                  f"{dst} receives (NCCL matches the k-th send with the k-th receive)")
    _run_batches(lowered, placement)


def _run_batches(lowered: DecodeOrder, placement: dict[int, int]) -> None:
    """All ranks run to the end under NCCL's batch rule, or a deadlock error."""
    batches = {r: _batches(acts) for r, acts in lowered.items()}
    at = {r: 0 for r in batches}
    posted: set[tuple[str, tuple]] = set()
    while any(at[r] < len(batches[r]) for r in batches):
        moved = False
        for r in batches:
            while at[r] < len(batches[r]):
                batch = batches[r][at[r]]
                if batch[0].kind == "D":
                    at[r] += 1
                    moved = True
                    continue
                for a in batch:
                    posted.add((a.kind, a.message))
                other = {"SEND": "RECV", "RECV": "SEND"}
                if all((other[a.kind], a.message) in posted for a in batch):
                    at[r] += 1
                    moved = True
                    continue
                break
        if not moved:
            stuck = {r: str(batches[r][at[r]][0]) for r in batches if at[r] < len(batches[r])}
            raise DecodeOrderError(f"decode order deadlocks under NCCL's batch rule: ranks wait at {stuck}")


@dataclass(frozen=True)
class DecodeSimulation:
    """A decode order run with given costs."""

    makespan: float
    busy: dict[int, float] = field(default_factory=dict)
    """Each rank's busy time / makespan."""

    @property
    def bubble_fraction(self) -> float:
        """Idle time / (ranks x makespan)."""
        return 1.0 - sum(self.busy.values()) / max(1, len(self.busy))


def is_decode_order(order: object) -> bool:
    """Whether ``order`` (``{rank: [action, ...]}``) holds decode actions."""
    if not isinstance(order, dict):
        return False
    return any(isinstance(a, DecodeAction) for acts in order.values() for a in acts[:1])


def simulate_decode(lowered: DecodeOrder, cost: float = 1.0) -> DecodeSimulation:
    """Each compute takes ``cost``, messages none; a receive waits for its send."""
    _, clock, busy = _play(lowered, cost, lambda a: a.message if a.kind == "RECV" else None,
                           "simulate_decode: the order deadlocks (validate it first)")
    makespan = max(clock.values()) if clock else 0.0
    return DecodeSimulation(makespan, {r: (busy[r] / makespan if makespan else 0.0) for r in lowered})
