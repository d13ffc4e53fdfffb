"""The decode order as data: per rank, actions over (stage, lane, round) (schedule layer, pure).

The decode program is a kind of the one action IR (:mod:`.actions`): ``D`` computes,
``SEND_D``/``RECV_D`` carry a stage's values, ``SEND_T``/``RECV_T`` the chosen tokens, each
naming a lane (its ``mb``) and a round. Like a training order it is built without tensors or
process groups, lowered (messages added), validated and simulated by plain functions, and the
training runtime's :class:`~.runtime.Interpreter` runs it:

* :func:`decode_order`: the compute actions. ``D(s, l, t)`` runs stage ``s`` for lane ``l``
  at round ``t`` (round 0 the prefill, then one token per round). Stage ``s`` needs stage
  ``s - 1``'s values of the same lane and round; stage 0 at round ``t`` needs the tokens the
  last stage chose at round ``t - 1``. Each rank runs, at each moment, the ready action of
  the lowest ``(round, lane, stage)``, found by running all ranks together with unit costs:
  every stage then handles lanes in the same order, so every channel carries its messages
  in one order at both ends.
* :func:`lower_decode`: adds the messages (``D``: the values of the stage's edges; ``T``: the
  new tokens, from the last stage to each stage that reads ``input_ids``). A compute's sends
  and the next compute's receives form one batch, as NCCL needs.
* :func:`validate_decode`: every compute once, on its stage's rank; on every directed channel
  the sends and receives name the same messages in the same order; and all ranks run to
  the end under NCCL's batch rule (the event loop training orders are checked with:
  :func:`~.batch_loop.run_batches`), else a :class:`DecodeOrderError` naming rank and step.
* :func:`simulate_decode`: makespan and each rank's busy fraction with given costs (per stage,
  the prefill apart, and a latency per message: what ``benchmarks/generate_decode.py`` measures),
  on the same event loop (what ``ps.simulate`` of a decode order runs).

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
from typing import Any, Callable, Mapping, Sequence, Union

from .actions import Action, ActionKind, comm_batches
from .batch_loop import run_batches
from .messages import Message, action_messages

__all__ = ["DecodeOrderError", "DecodeOrder", "decode_order", "lower_decode", "validate_decode", "simulate_decode",
           "DecodeSimulation", "DecodeCosts", "decode_cost_fn", "content_round", "round_of", "decision_lag", "is_decode_order", "decode_message"]

D, SEND_D, RECV_D, SEND_T, RECV_T = (ActionKind.D, ActionKind.SEND_D, ActionKind.RECV_D, ActionKind.SEND_T,
                                     ActionKind.RECV_T)


class DecodeOrderError(ValueError):
    """A decode order that is incomplete, mis-ordered or would deadlock (the message names the
    rank and step)."""


DecodeOrder = dict[int, list[Action]]


def decode_message(a: Action) -> Message:
    """The message a decode SEND or RECV names: the same for a send and its receive.

    Example:
        >>> str(decode_message(Action(1, RECV_D, 0, peer=0, round=2)))
        'stage 0 -> stage 1 values of lane 0 round 2'
    """
    return action_messages(a, {})[0]


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
            order[placement[s]].append(Action(s, D, lane, round=t))
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
    rounds = 1 + max((round_of(a) for acts in order.values() for a in acts), default=-1)
    readers_of: dict[int, list[int]] = {p: sorted(s for s, srcs in links.items() if p in srcs) for p in stages}
    token_to: dict[int, int] = {}
    for s in sorted(token_readers, reverse=True):
        token_to[placement[s]] = s
    sends: dict[int, list[list[Action]]] = {}  # rank -> the sends after each of its computes
    channel: dict[tuple[int, int], list[Action]] = {}  # (src rank, dst rank) -> sends in order
    for r, actions in order.items():
        sends[r] = []
        for a in actions:
            s, lane, t = a.stage, a.lane, round_of(a)
            out = [Action(s, SEND_D, lane, d, t) for d in readers_of[s] if placement[d] != r]
            if s == last and t + 1 < rounds:
                out += [Action(s, SEND_T, lane, d, t + 1) for q, d in sorted(token_to.items()) if q != r]
            sends[r].append(out)
            for m in out:
                channel.setdefault((r, placement[m.peer or 0]), []).append(m)  # a decode send names its peer
    ticks = _start_ticks(order, placement)
    # Each receive goes in the first gap between computes of its rank that comes once its send
    # has happened (in the unit-cost run the order was built from): a value travelling far (a
    # skip edge, the tokens) is received when it is sent, not when it is used, so no send waits
    # on a receiver busy with messages that depend on it. A channel's receives keep its order.
    gaps: dict[int, dict[int, list[tuple[int, int, Action]]]] = {r: {} for r in order}
    for (src, dst), msgs in channel.items():
        for k, m in enumerate(msgs):
            sent = ticks[(m.stage, m.lane, content_round(m))] + 1
            gap = next(i for i, a in enumerate(order[dst]) if ticks[(a.stage, a.lane, round_of(a))] >= sent)
            assert m.peer is not None
            recv = Action(m.peer, RECV_T if m.kind is SEND_T else RECV_D, m.lane, m.stage, m.round)
            gaps[dst].setdefault(gap, []).append((src, k, recv))
    lowered: DecodeOrder = {}
    for r, actions in order.items():
        out_r: list[Action] = []
        for i, (a, after) in enumerate(zip(actions, sends[r])):
            out_r.extend(recv for _, _, recv in sorted(gaps[r].get(i, []), key=lambda x: (x[0], x[1])))
            out_r.append(a)
            out_r.extend(after)
        lowered[r] = out_r
    return lowered


def round_of(a: Action) -> int:
    """A decode action's round (asserting it is one)."""
    assert a.round is not None, f"{a} is not a decode action"
    return a.round


def content_round(a: Action) -> int:
    """The round whose work ``a`` belongs to: its own, or for tokens the round that chose them
    (the tokens labelled ``t`` are round ``t - 1``'s)."""
    return round_of(a) - 1 if a.kind is SEND_T or a.kind is RECV_T else round_of(a)


def decision_lag(lowered: DecodeOrder, placement: Mapping[int, int]) -> int:
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
        first: dict[tuple[int, int], int] = {}
        for b, batch in enumerate(_steps(actions)):
            for a in batch:
                if (a.kind is D and a.stage == last) or a.kind is RECV_T:
                    known.setdefault((a.lane, content_round(a)), b)
                latest[(a.lane, content_round(a))] = b
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


def _start_ticks(order: DecodeOrder, placement: Mapping[int, int]) -> dict[tuple[int, int, int], int]:
    """Each compute's start in a unit-cost run of the compute-only ``order`` (as soon as its
    rank is free and the stage before it, or the last stage's previous round, has finished)."""
    stages = sorted(placement)
    first, last = stages[0], stages[-1]
    done: dict[tuple[int, int, int], int] = {}
    starts: dict[tuple[int, int, int], int] = {}
    clock = {r: 0 for r in order}
    pos = {r: 0 for r in order}
    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = round_of(a)
                if a.stage != first:
                    need: tuple[int, int, int] | None = (stages[stages.index(a.stage) - 1], a.lane, t)
                else:
                    need = (last, a.lane, t - 1) if t > 0 else None
                if need is not None and need not in done:
                    break
                begin = max(clock[r], done[need] if need is not None else 0)
                starts[(a.stage, a.lane, t)] = begin
                clock[r] = done[(a.stage, a.lane, t)] = begin + 1
                pos[r] += 1
                moved = True
        if not moved:
            raise DecodeOrderError("decode order: a compute waits for one that never runs")
    return starts


def _steps(actions: list[Action]) -> list[list[Action]]:
    """Each compute alone, each maximal run of comm actions as one batch (as the runtime runs them)."""
    batches = dict(comm_batches(list(actions)))
    out: list[list[Action]] = []
    for i, a in enumerate(actions):
        if a.kind.is_compute:
            out.append([a])
        elif i in batches:
            out.append(batches[i])
    return out


def validate_decode(lowered: DecodeOrder, placement: Mapping[int, int], *, lanes: int, rounds: int) -> None:
    """Raise :class:`DecodeOrderError` naming the rank and step where ``lowered`` is wrong."""
    want = {(s, lane, t) for s in placement for lane in range(lanes) for t in range(rounds)}
    seen: set[tuple[int, int, int]] = set()
    channels: dict[tuple[int, int, bool], list[Message]] = {}
    for r, actions in lowered.items():
        for step, a in enumerate(actions):
            if a.round is None:
                raise DecodeOrderError(f"decode order: rank {r} step {step}: {a} is not a decode action")
            if a.kind is D:
                key = (a.stage, a.lane, a.round)
                if placement.get(a.stage) != r or key in seen or key not in want:
                    raise DecodeOrderError(f"decode order: rank {r} step {step}: {a} is misplaced, repeated or "
                                           "out of range")
                seen.add(key)
                continue
            assert a.peer is not None
            src, dst = (r, placement[a.peer]) if a.is_send else (placement[a.peer], r)
            channels.setdefault((src, dst, a.is_send), []).append(decode_message(a))
    if seen != want:
        missing = sorted(want - seen)[:3]
        raise DecodeOrderError(f"decode order: computes (stage, lane, round) missing, e.g. {missing}")
    for (src, dst, is_send), msgs in channels.items():
        if is_send and channels.get((src, dst, False), []) != msgs:
            raise DecodeOrderError(f"decode order: rank {src} sends to rank {dst} in another order than rank "
                                   f"{dst} receives (NCCL matches the k-th send with the k-th receive)")
    run = run_batches(lowered, {})  # type: ignore[arg-type]  # list[Action] is an Order with no idle step
    if run.blocked:
        stuck = {r: f"step {run.ptr[r]} ({lowered[r][run.ptr[r]]}) waits for {m}" for r, (m, _) in run.blocked.items()}
        raise DecodeOrderError(f"decode order deadlocks under NCCL's batch rule: {stuck}")


@dataclass(frozen=True)
class DecodeSimulation:
    """A decode order run with given costs."""

    makespan: float
    busy: dict[int, float] = field(default_factory=dict)
    """Each rank's busy time / makespan."""
    timeline: dict[int, list[tuple[float, float, Action]]] = field(default_factory=dict, repr=False)
    """Per rank, ``(start, end, action)`` of what ran (a batch's comm actions at its post time)."""

    @property
    def bubble_fraction(self) -> float:
        """Idle time / (ranks x makespan)."""
        return 1.0 - sum(self.busy.values()) / max(1, len(self.busy))


def is_decode_order(order: object) -> bool:
    """Whether ``order`` (``{rank: [action, ...]}``) holds decode actions."""
    if not isinstance(order, dict):
        return False
    return any(isinstance(a, Action) and a.round is not None for acts in order.values() for a in acts[:1])


DecodeCosts = Union[float, Mapping[Any, float], Callable[[int, str], float], None]
"""What a decode step costs: one number for every ``D``; or ``{"D": t, "prefill": t0}`` per kind,
``{(stage, "D"): t, (stage, "prefill"): t0}`` per stage and kind (the two may mix: a missing pair
takes the kind's figure; no prefill figure at all, the stage's ``D``); or ``f(stage, kind) -> t`` with
``kind`` ``"D"`` or ``"prefill"``. ``prefill`` is round 0 (the whole prompt), ``D`` a later round."""


def decode_cost_fn(costs: DecodeCosts) -> Callable[[int, str], float]:
    """``costs`` (see :data:`DecodeCosts`) as ``f(stage, "D" | "prefill") -> t``.

    Example:
        >>> f = decode_cost_fn({"D": 2.0, (1, "D"): 3.0, (0, "prefill"): 8.0})
        >>> f(0, "D"), f(1, "D"), f(0, "prefill"), f(1, "prefill")
        (2.0, 3.0, 8.0, 3.0)
    """
    if callable(costs):
        return costs
    if costs is None or isinstance(costs, (int, float)):
        value = 1.0 if costs is None else float(costs)
        return lambda stage, kind: value
    unknown = sorted(str(k) for k in costs if (k[1] if isinstance(k, tuple) else k) not in ("D", "prefill"))
    if unknown:
        raise ValueError(f"decode costs take the kinds 'D' and 'prefill' (alone or as (stage, kind)), got {unknown}")
    table = {k: float(v) for k, v in costs.items()}

    def cost(stage: int, kind: str) -> float:
        step = table.get((stage, "D"), table.get("D", 1.0))
        if kind == "D":
            return step
        return table.get((stage, "prefill"), table.get("prefill", step))

    return cost


def simulate_decode(lowered: DecodeOrder, costs: DecodeCosts = None, *,
                    comm_latency: float | Callable[[int, int], float] = 0.0,
                    lane_scale: Sequence[float] | None = None) -> DecodeSimulation:
    """``lowered`` run under NCCL's batch rule on the event loop that times and checks training
    orders (:func:`~.batch_loop.run_batches`): each ``D`` priced by ``costs`` (see
    :data:`DecodeCosts`; default 1 each), each message arriving ``comm_latency`` after both
    ends posted it (a number, or ``f(src_stage, dst_stage)``), each lane's times multiplied by
    ``lane_scale[lane]`` where given (lanes of different row counts)."""
    price = decode_cost_fn(costs)
    run = run_batches(lowered, {}, lambda stage, kind: price(stage, "D"), comm_latency,  # type: ignore[arg-type]
                      lane_scale, prefill=lambda stage: price(stage, "prefill"))  # list[Action]: an Order, no idle step
    if run.blocked:
        raise DecodeOrderError("simulate_decode: the order deadlocks (validate it first)")
    ends = {r: max((end for _, end, _ in spans), default=0.0) for r, spans in run.timeline.items()}
    busy = {r: sum(end - start for start, end, a in spans if a.kind is D) for r, spans in run.timeline.items()}
    makespan = max(ends.values(), default=0.0)
    return DecodeSimulation(makespan, {r: (busy[r] / makespan if makespan else 0.0) for r in lowered},
                            run.timeline)
