"""The event loop over compute-only orders, on integers: what :func:`.simulate` times
and :func:`.validate` dry-runs.

Sits under :mod:`.simulate` and :mod:`.validate` in the schedule layer, and holds the
one integer encoding of action kinds (:data:`KINDS`, :data:`CODE`) both use. An order's
compute actions (F, I, W, B) become integer keys ``(code * S + stage) * M + mb``
(code F=0, I=1, W=2, B=3), and the dependency rule of :mod:`.deps` becomes, per
``(code, stage)``, a short list of ``(required key base, latency)`` pairs, the same
for every microbatch. Every rank then runs its list in order, each as far as it can:
an action starts at ``max(rank free, every requirement's end + its latency)``; a rank
whose next action needs something not yet done waits until it is (a queue of ranks,
woken by the key they wait for). A full ``B`` also completes its ``I``, so a required
``I`` is met by either (:func:`.deps.satisfies`).

No Action object, enum or dict of tuples is touched inside the loop, which is what
makes a 1F1B order of 1024 ranks and 2048 microbatches (4M actions) run in seconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

from .actions import Action, ActionKind, Order
from .deps import DepIndex

__all__ = ["LoweredOrder", "CODE", "KINDS", "COMPUTE_KINDS", "DEFAULT_COSTS", "CostSpec", "Encoded", "LoopRun", "encode",
           "requirement_table", "run_loop", "stopped_at", "held_peaks", "stage_cost_table"]

KINDS = (ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B,
         ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
"""Kind of each integer code, the one encoding of ``schedule/``: the compute kinds F=0, I=1,
W=2, B=3 (what the loop and its cost tables index), then the comm kinds 4-7."""
CODE = {k.value: c for c, k in enumerate(KINDS)}
"""Code of each kind by its value (``CODE["B"] == 3``): hot loops index by ``a.kind._value_``,
which skips ``Enum.__hash__`` (a Python-level call)."""
COMPUTE_KINDS = KINDS[:4]
"""The compute kinds, codes 0-3; a code ``>= len(COMPUTE_KINDS)`` is a comm action."""
_COMPUTE_CODE = {k.value: CODE[k.value] for k in COMPUTE_KINDS}
_B = CODE["B"]


class LoweredOrder(ValueError):
    """An order given to the compute-only loop holds a communication action."""


@dataclass
class Encoded:
    """A compute-only order as integers: ``keys[r]`` holds rank ``r``'s actions, idle
    ``None`` steps dropped, each as ``(code * S + stage) * M + mb``."""

    ranks: list[int]
    keys: dict[int, list[int]]
    num_stages: int
    num_mb: int

    def steps(self, order: Order, rank: int) -> list[int]:
        """Index in ``order[rank]`` of each encoded action of ``rank``."""
        return [j for j, a in enumerate(order[rank]) if a is not None]

    def action(self, key: int) -> tuple[int, ActionKind, int]:
        """``(stage, kind, mb)`` of ``key``."""
        rest, mb = divmod(key, self.num_mb)
        code, stage = divmod(rest, self.num_stages)
        return stage, KINDS[code], mb


def encode(order: Order, num_stages: int | None = None) -> Encoded:
    """Integer form of a compute-only ``order``; ``ValueError`` on a comm action."""
    S = num_stages if num_stages is not None else max(
        (a.stage + 1 for acts in order.values() for a in acts if a is not None), default=0)
    M = max((a.mb + 1 for acts in order.values() for a in acts if a is not None), default=1)
    code = _COMPUTE_CODE
    try:
        keys = {r: [(code[a.kind._value_] * S + a.stage) * M + a.mb for a in acts if a is not None]
                for r, acts in order.items()}
    except KeyError as e:
        raise LoweredOrder(f"the compute-only event loop got a communication action ({e.args[0]})") from None
    return Encoded(list(order), keys, S, M)


def requirement_table(index: DepIndex, stage_rank: dict[int, int], num_mb: int,
                      latency: Callable[[int, int], float]) -> list[list[tuple[int, float]]]:
    """Per ``code * S + stage``: ``(key base, latency)`` of each requirement (add ``mb``).

    ``latency(src_stage, dst_stage)`` is the time a value takes along a link between
    two ranks (either direction); requirements on the same rank wait no extra time. A
    stage that never runs counts as remote, so waiting on it shows as a deadlock.
    """
    S = index.num_stages
    table: list[list[tuple[int, float]]] = [[] for _ in range(4 * S)]
    for code, kind in enumerate(COMPUTE_KINDS):
        for s in range(S):
            reqs = []
            for ds, dk, _ in index.keys(s, kind, 0):
                remote = stage_rank.get(ds, -1) != stage_rank.get(s, -2)
                lat = (latency(ds, s) if dk is ActionKind.F else latency(s, ds)) if remote else 0.0
                reqs.append(((CODE[dk._value_] * S + ds) * num_mb, float(lat)))
            table[code * S + s] = reqs
    return table


@dataclass
class LoopRun:
    """How far every rank got: start times of what ran, where each stopped, what it waits for."""

    starts: Mapping[int, list[float]]
    """Per rank, the start time of each action run, in list order (idle steps dropped);
    its length is how many of the rank's actions ran."""
    free: dict[int, float]
    """Per rank, when its last action ended."""
    blocked: dict[int, int]
    """Per stuck rank, the key it waits for (empty when every rank finished)."""


def run_loop(enc: Encoded, table: Sequence[Sequence[tuple[int, float]]], cost: Sequence[float],
             scale: Sequence[float] | None = None) -> LoopRun:
    """Run every rank of ``enc`` as far as it can (see the module docstring).

    ``table[code * S + stage]`` lists ``(key base, latency)`` of each requirement
    (:func:`requirement_table`); ``cost[code * S + stage]`` is one such action's time,
    times ``scale[mb]`` when given (microbatches of different sizes; a message's latency
    scales with the microbatch it carries).
    """
    M, S = enc.num_mb, enc.num_stages
    done = [-1.0] * (4 * S * M)  # key -> end time; -1 = not yet
    b_to_i = 2 * S * M  # key of B minus key of I for the same (stage, mb)
    b_first = _B * S
    deltas = _deltas(table, M)
    starts, its, pending, free, queue = _rank_state(enc)  # per rank, by position 0..R-1
    waiter = [-1] * len(done)  # key -> the one rank waiting on it (more in `extra`)
    extra: dict[int, list[int]] = {}
    pop, push = queue.popleft, queue.append
    while queue:
        i = pop()
        append, t = starts[i].append, free[i]
        k = pending[i]
        src = its[i] if k is None else chain((k,), its[i])  # from the key it stopped at
        pending[i] = None
        for k in src:
            sk = k // M
            start = t
            miss = -1
            f = 1.0 if scale is None else scale[k - sk * M]
            for d, lat in deltas[sk]:
                e = done[k + d]
                if e < 0.0:
                    miss = k + d
                    break
                e += lat * f
                if e > start:
                    start = e
            if miss >= 0:
                _park(i, k, miss, pending, waiter, extra)
                break
            append(start)
            t = start + cost[sk] * f
            if done[k] < 0.0:
                done[k] = t
                if waiter[k] >= 0:
                    push(waiter[k])
                    if extra:
                        queue.extend(extra.pop(k, ()))
            # a full backward also delivers its I (written out twice, not looped: this runs per action)
            if sk >= b_first:
                k -= b_to_i
                if done[k] < 0.0:
                    done[k] = t
                    if waiter[k] >= 0:
                        push(waiter[k])
                        if extra:
                            queue.extend(extra.pop(k, ()))
        free[i] = t
    return LoopRun(dict(zip(enc.ranks, starts)), dict(zip(enc.ranks, free)), _blocked(enc, pending, deltas, done))


def _deltas(table: Sequence[Sequence[tuple[int, float]]], M: int) -> list[tuple[tuple[int, float], ...]]:
    """Per ``code * S + stage``, each requirement as ``(delta, latency)``: its key is the
    action's own key plus a fixed delta."""
    return [tuple((base - sk * M, lat) for base, lat in reqs) for sk, reqs in enumerate(table)]


def _rank_state(enc: Encoded) -> tuple[list[list[float]], list[Iterator[int]], list[int | None], list[float],
                                       deque[int]]:
    """Every rank's state as :func:`run_loop` starts, by position: the start times of what it
    ran, its keys still to run, the key it stopped at, when it is free; and the queue of
    ranks to run (all of them)."""
    R = len(enc.ranks)
    return [[] for _ in range(R)], [iter(enc.keys[r]) for r in enc.ranks], [None] * R, [0.0] * R, deque(range(R))


def _park(i: int, k: int, miss: int, pending: list[int | None], waiter: list[int],
          extra: dict[int, list[int]]) -> None:
    """Stop rank ``i`` at key ``k`` until key ``miss`` is done (called once per stop, not per action)."""
    if waiter[miss] < 0:
        waiter[miss] = i
    else:
        extra.setdefault(miss, []).append(i)
    pending[i] = k


def _blocked(enc: Encoded, pending: list[int | None], deltas: list[tuple[tuple[int, float], ...]],
             done: list[float]) -> dict[int, int]:
    """Per stuck rank, the first requirement not done of the key it stopped at."""
    M = enc.num_mb
    return {enc.ranks[i]: next(k + d for d, _ in deltas[k // M] if done[k + d] < 0.0)
            for i, k in enumerate(pending) if k is not None}


def stopped_at(enc: Encoded, order: Order, run: LoopRun) -> dict[int, tuple[int, Action]]:
    """``{rank: (step, awaited action)}`` of every rank ``run`` left stuck: the index in
    ``order[rank]`` it stopped at and the compute action it waits for."""
    out = {}
    for r in sorted(run.blocked):
        stage, kind, mb = enc.action(run.blocked[r])
        out[r] = (enc.steps(order, r)[len(run.starts[r])], Action(stage, kind, mb))
    return out


def held_peaks(enc: Encoded, add: Sequence[float], release: Sequence[float],
               extra: Sequence[float] | None = None, scale: Sequence[float] | None = None) -> dict[int, float]:
    """Per rank, the most bytes held at once when each action ``code * S + stage`` adds
    ``add[...]`` as it starts and frees ``release[...]`` once it ends (optional ``extra``
    on top while it runs): e.g. a stage's activations added by F, freed by B or W; each
    times ``scale[mb]`` when given.

    Depends on each rank's list only, not on timing.
    """
    M = enc.num_mb
    out: dict[int, float] = {}
    for r in enc.ranks:
        cur = peak = 0.0
        for k in enc.keys[r]:
            sk = k // M
            f = 1.0 if scale is None else scale[k - sk * M]
            cur += add[sk] * f
            if extra is not None and cur + extra[sk] * f > peak:
                peak = cur + extra[sk] * f
            if cur > peak:
                peak = cur
            cur -= release[sk] * f
        out[r] = peak
    return out


# ---- simulate()'s inputs, as the loop's tables -------------------------------------------

DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "I": 1.0, "W": 1.0}
"""Cost per kind when none is given (``B`` = ``I + W``)."""

CostSpec = Union[Mapping[Any, float], Callable[[int, str], float], None]
"""``{"F": t, ...}`` per kind, ``{(stage, "F"): t, ...}`` per stage and kind (the two
may mix: a stage's missing kind takes the kind's value), or ``f(stage, kind) -> t``."""


def kind_defaults(costs: Mapping[Any, float] | None) -> dict[str, float]:
    merged = dict(DEFAULT_COSTS)
    if costs:
        flat = {k: v for k, v in costs.items() if not isinstance(k, tuple)}
        unknown = sorted(map(str, set(flat) - {"F", "B", "I", "W"}))
        bad = [k for k in costs if isinstance(k, tuple) and (len(k) != 2 or str(k[1]) not in ("F", "B", "I", "W"))]
        if unknown or bad:
            raise ValueError(f"unknown cost keys {unknown or bad}: expected some of F, I, W (and B to override "
                             "I + W), or (stage, kind) pairs such as (0, 'F')")
        merged.update({k: float(v) for k, v in flat.items()})
    return merged


def stage_cost_table(costs: CostSpec, num_stages: int) -> list[float]:
    """Cost of each ``code * S + stage`` (codes of :mod:`.event_loop`: F, I, W, B).

    Example:
        >>> stage_cost_table({"F": 2, (1, "F"): 5}, 2)[:2], stage_cost_table(None, 1)
        ([2.0, 5.0], [1.0, 1.0, 1.0, 2.0])
    """
    S = num_stages
    table = [0.0] * (4 * S)
    if callable(costs):
        for s in range(S):
            f, i, w = (float(costs(s, k)) for k in "FIW")
            table[s], table[S + s], table[2 * S + s] = f, i, w
            try:
                b = costs(s, "B")
            except (KeyError, ValueError):
                b = None
            table[3 * S + s] = i + w if b is None else float(b)
        return table
    kinds = kind_defaults(costs)
    per = {(int(k[0]), str(k[1])): float(v) for k, v in (costs or {}).items() if isinstance(k, tuple)}
    for s in range(S):
        f, i, w = (per.get((s, k), kinds[k]) for k in "FIW")
        b = per.get((s, "B"), kinds["B"] if "B" in kinds else i + w)
        table[s], table[S + s], table[2 * S + s], table[3 * S + s] = f, i, w, b
    return table


def kind_summary(table: list[float], num_stages: int) -> dict[str, float]:
    if num_stages == 0:
        table, num_stages = stage_cost_table(None, 1), 1
    return {k.value: table[c * num_stages] for c, k in enumerate(COMPUTE_KINDS)}


def latency_fn(comm_latency: float | Mapping[tuple[int, int], float]) -> Callable[[int, int], float]:
    if isinstance(comm_latency, Mapping):
        table = {(int(a), int(b)): float(t) for (a, b), t in comm_latency.items()}
        return lambda src, dst: table.get((src, dst), table.get((dst, src), 0.0))
    value = float(comm_latency)
    return lambda src, dst: value


def per_stage(values: Mapping[int, float] | Sequence[float] | None, num_stages: int) -> list[float] | None:
    if values is None:
        return None
    if isinstance(values, Mapping):
        return [float(values.get(s, 0.0)) for s in range(num_stages)]
    out = [float(v) for v in values]
    return out + [0.0] * (num_stages - len(out))
