"""Event simulation of a pipeline order: when each action runs, and what it costs.

Sits after order generation (and optionally lowering) in the schedule layer:
``orders.* -> simulate`` gives makespan, bubble fraction and peak activation
count per rank without any tensors or process group. Rendering of the result
(text, rich, SVG, HTML) lives in :mod:`pippy_split.schedule.render`.

Model: every rank runs its list in order (``None`` steps are skipped, so idle
time comes only from waiting); an action starts at ``max(rank free, inputs
ready)``. Compute-only orders take their inputs from :mod:`.deps`. Lowered
orders (with SEND/RECV) follow the batch rule of :mod:`.actions`, as NCCL
runs them: a batch is posted once the rank reaches it and its previous batch
has completed; it completes once every message in it has its counterpart
posted (plus ``comm_latency``); a compute action does not wait for a batch
unless it consumes a message that batch receives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .actions import Action, ActionKind, Order
from .deps import DepIndex, Link, chain_links
from .messages import Message, action_messages, recv_action, send_action

__all__ = ["Simulation", "simulate", "DEFAULT_COSTS", "BatchRun", "run_batches"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W

DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "I": 1.0, "W": 1.0}

Key = tuple[int, ActionKind, int]  # (stage, kind, mb)
_COMM = frozenset(k for k in ActionKind if k.is_comm)


@dataclass
class Simulation:
    """The outcome of :func:`simulate`."""

    makespan: float
    """Time at which the last action on any rank ends."""
    bubble_fraction: float
    """Total idle time over all ranks divided by ``num_ranks * makespan``."""
    peak_activations: dict[int, int]
    """Per rank, the most ``(stage, mb)`` forward activations held at once
    (held from F until B, or until W when the backward is split)."""
    timeline: dict[int, list[tuple[float, float, Action]]]
    """Per rank, ``(start, end, action)`` in execution order."""
    num_ranks: int
    costs: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_COSTS))
    """Cost per action kind used (``B`` included)."""

    def __str__(self) -> str:
        from . import render

        return render.render_text(self)

    def __rich__(self):  # noqa: ANN204 - rich renderable, type depends on render
        from . import render

        return render.render_rich(self)

    def to_svg(self, path: str | None = None) -> str:
        """SVG timeline, one row per rank; also written to ``path`` when given."""
        from . import render

        return render.render_svg(self, path)

    def _repr_html_(self) -> str:
        from . import render

        return render.render_html(self)


def _cost_table(costs: Mapping[str, float] | None) -> dict[ActionKind, float]:
    merged = dict(DEFAULT_COSTS)
    if costs:
        unknown = sorted(set(costs) - {"F", "B", "I", "W"})
        if unknown:
            raise ValueError(f"unknown cost keys {unknown}: expected some of F, I, W (and B to override I + W)")
        merged.update({k: float(v) for k, v in costs.items()})
    merged.setdefault("B", merged["I"] + merged["W"])
    table = {kind: 0.0 for kind in ActionKind}  # comm actions cost nothing
    table.update({F: merged["F"], B: merged["B"], I: merged["I"], W: merged["W"]})
    return table


def _stage_ranks(order: Order) -> dict[int, int]:
    """Rank of each stage: the rank whose list holds its F (else any compute action)."""
    ranks: dict[int, int] = {}
    fallback: dict[int, int] = {}
    for rank, actions in order.items():
        for a in actions:
            if a is None:
                continue
            if a.kind is F:
                ranks.setdefault(a.stage, rank)
            elif a.kind not in _COMM:
                fallback.setdefault(a.stage, rank)
    return {**fallback, **ranks}


class _Requirements:
    """What each compute action of a compute-only order waits for: ``(stage, kind, extra
    latency)`` triples, the same for every microbatch, so they are worked out once per
    (stage, kind, rank). (Lowered orders run under the batch rule: :func:`run_batches`.)"""

    def __init__(self, index: DepIndex, stage_rank: dict[int, int], latency: float) -> None:
        self.index, self.stage_rank, self.latency = index, stage_rank, latency
        self.cache: dict[tuple[int, ActionKind, int], tuple[tuple[int, ActionKind, float], ...]] = {}

    def _remote(self, stage: int, rank: int) -> bool:
        # A stage that never runs counts as remote, so waiting on it reports a deadlock.
        return self.stage_rank.get(stage, -1) != rank

    def of(self, stage: int, kind: ActionKind, rank: int) -> tuple[tuple[int, ActionKind, float], ...]:
        key = (stage, kind, rank)
        found = self.cache.get(key)
        if found is None:
            deps = self.index.keys(stage, kind, 0)
            found = self.cache[key] = tuple((ds, dk, self.latency if self._remote(ds, rank) else 0.0)
                                            for ds, dk, _ in deps)
        return found


def _peak_activations(actions: Iterable[Action | None]) -> int:
    held = peak = 0
    for a in actions:
        if a is None:
            continue
        if a.kind is F:
            held += 1
            peak = max(peak, held)
        elif a.kind is B or a.kind is W:
            held -= 1
    return peak


def _deadlock_error(order: Order, ptr: dict[int, int], blocked_on: dict[int, Key]) -> ValueError:
    lines = []
    for rank in sorted(blocked_on):
        stage, kind, mb = blocked_on[rank]
        action = order[rank][ptr[rank]]
        lines.append(f"rank {rank} step {ptr[rank]} ({action}) waits for {stage}{kind.value}{mb}")
    return ValueError(
        "schedule deadlocks: no rank can progress; "
        + "; ".join(lines[:8])
        + (f"; ... and {len(lines) - 8} more ranks" if len(lines) > 8 else "")
    )


def simulate(
    order: Order,
    costs: Mapping[str, float] | None = None,
    *,
    links: Iterable[Link] | None = None,
    comm_latency: float = 0.0,
) -> Simulation:
    """Simulate ``order`` and report makespan, bubble and activation memory.

    Args:
        order: ``{rank: [Action | None, ...]}``, compute-only or lowered.
        costs: time per kind, keys among ``F``, ``I``, ``W`` (default 1 each) and
            ``B`` (default ``I + W``). SEND/RECV cost 0.
        links: ``(src, dst, carries_grad)`` stage links; default the linear chain
            over ``max stage + 1`` stages.
        comm_latency: added when a value crosses ranks.

    Returns:
        A :class:`Simulation`.

    Raises:
        ValueError: when no rank can progress (deadlock), naming each stuck
            rank, its step and the action it waits for.

    Example:
        >>> from pippy_split.schedule.orders import get_order_spec
        >>> sim = simulate(get_order_spec("1F1B").compute_order(4, 8))
        >>> sim.makespan, round(sim.bubble_fraction, 3)
        (33.0, 0.273)
    """
    cost = _cost_table(costs)
    stages = [a.stage for acts in order.values() for a in acts if a is not None]
    num_stages = max(stages) + 1 if stages else 0
    lowered = any(a is not None and a.kind in _COMM for acts in order.values() for a in acts)
    if lowered:
        return _simulate_batches(order, cost, chain_links(num_stages) if links is None else list(links),
                                 num_stages, float(comm_latency))
    index = DepIndex(chain_links(num_stages) if links is None else links, num_stages)
    reqs = _Requirements(index, _stage_ranks(order), float(comm_latency))

    done: dict[Key, float] = {}
    waiting: dict[Key, list[int]] = {}
    ptr = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in order}
    blocked_on: dict[int, Key] = {}
    queue = deque(order)

    def finish(key: Key, end: float) -> None:
        if key not in done:
            done[key] = end
            woken = waiting.pop(key, None)
            if woken:
                queue.extend(woken)

    templates = reqs.cache  # (stage, kind, rank) -> requirements, filled on first use
    while queue:
        rank = queue.popleft()
        actions = order[rank]
        blocked_on.pop(rank, None)
        pos, t_free, rows = ptr[rank], free[rank], timeline[rank]
        while pos < len(actions):
            a = actions[pos]
            if a is None:
                pos += 1
                continue
            stage, kind, mb = a.stage, a.kind, a.mb
            needs = templates.get((stage, kind, rank)) or reqs.of(stage, kind, rank)
            start = t_free
            missing = None
            for ds, dk, lat in needs:
                end = done.get((ds, dk, mb))
                if end is None:
                    missing = (ds, dk, mb)
                    break
                if end + lat > start:
                    start = end + lat
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                blocked_on[rank] = missing
                break
            t_free = start + cost[kind]
            rows.append((start, t_free, a))
            pos += 1
            key = (stage, kind, mb)
            if key not in done:
                done[key] = t_free
                woken = waiting.pop(key, None)
                if woken:
                    queue.extend(woken)
            if kind is B:  # a full backward also delivers the input gradient
                finish((stage, I, mb), t_free)
        ptr[rank], free[rank] = pos, t_free

    if blocked_on:
        raise _deadlock_error(order, ptr, blocked_on)
    return _summarize(order, timeline, cost)


def _simulate_batches(order: Order, cost: dict, links: list[Link], num_stages: int, latency: float) -> Simulation:
    """A lowered order under the batch rule (see the module docstring)."""
    from .lower import peer_table

    run = run_batches(order, peer_table(num_stages, links, _stage_ranks(order)), cost, latency)
    if run.blocked:
        lines = []
        for r in sorted(run.blocked):
            m, by_sender = run.blocked[r]
            other = send_action(m, True) if by_sender else recv_action(m, True)
            lines.append(f"rank {r} step {run.ptr[r]} ({order[r][run.ptr[r]]}) waits for {other}")
        raise ValueError("schedule deadlocks: no rank can progress; " + "; ".join(lines[:8])
                         + (f"; ... and {len(lines) - 8} more ranks" if len(lines) > 8 else ""))
    return _summarize(order, run.timeline, cost)


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


def run_batches(order: Order, table: dict, cost: Mapping[ActionKind, float] | None = None,
                latency: float = 0.0) -> BatchRun:
    """Run a lowered order under NCCL's batch rule, the one event loop that ``simulate``
    (times) and ``validate`` (deadlocks) share: a rank posts a batch once it reaches it
    and its previous batch completed; a batch completes once every message in it has its
    counterpart posted (plus ``latency``); a compute action waits only for the batches
    that receive what it consumes. Ranks that can never go on are left in ``blocked``.

    Raises:
        ValueError: a comm action names a peer it does not exchange with (from
            :func:`~pippy_split.schedule.messages.action_messages`).
    """
    cost = cost or {}
    posted: dict[tuple[Message, bool], float] = {}  # (message, by its sender?) -> time posted
    waiting: dict[tuple[Message, bool], list[int]] = {}
    arrival: dict[Message, float] = {}  # completion time of the batch that receives it
    posts: dict[tuple[int, int], list[Message]] = {}
    ptr = {r: 0 for r in order}
    free = {r: 0.0 for r in order}  # when the rank's compute is free
    stream = {r: 0.0 for r in order}  # when the rank's previous batch completed
    timeline: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in order}
    blocked: dict[int, tuple[Message, bool]] = {}
    queue = deque(sorted(order))
    while queue:
        rank = queue.popleft()
        acts, pos = order[rank], ptr[rank]
        blocked.pop(rank, None)
        while pos < len(acts):
            a = acts[pos]
            if a is None:
                pos += 1
                continue
            if a.kind.is_compute:
                start = free[rank]
                for m in _consumed(a, table):
                    start = max(start, arrival.get(m, start))
                free[rank] = start + cost.get(a.kind, 0.0)
                timeline[rank].append((start, free[rank], a))
                pos += 1
                continue
            end, ops = pos, []
            while end < len(acts) and (acts[end] is None or acts[end].kind.is_comm):
                if acts[end] is not None:
                    msgs = posts.get((rank, end))
                    if msgs is None:
                        msgs = posts[(rank, end)] = action_messages(acts[end], table)
                    ops += [(m, acts[end].is_send) for m in msgs]
                end += 1
            t_post = max(free[rank], stream[rank])
            for op in ops:
                if op not in posted:
                    posted[op] = t_post
                    queue.extend(waiting.pop(op, ()))
            missing = next(((m, not side) for m, side in ops if (m, not side) not in posted), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                blocked[rank] = missing
                break
            done = max([t_post] + [posted[(m, not side)] for m, side in ops]) + latency
            for m, side in ops:
                if not side:
                    arrival[m] = done
            stream[rank] = done
            for i in range(pos, end):
                if acts[i] is not None:
                    timeline[rank].append((t_post, t_post, acts[i]))
            pos = end
        ptr[rank] = pos
    return BatchRun(timeline, ptr, blocked, posts)


def _consumed(a: Action, table: dict) -> list[Message]:
    """Remote messages compute action ``a`` reads: activations for F, gradients for B/I."""
    peers = table[a.stage]
    if a.kind is F:
        return [Message("F", src, a.stage, a.mb) for src in peers.recv_f]
    if a.kind is B or a.kind is I:
        return [Message("B", dst, a.stage, a.mb) for dst in peers.recv_b]
    return []


def _summarize(order: Order, timeline: dict[int, list[tuple[float, float, Action]]], cost: dict) -> Simulation:
    num_ranks = len(order)
    makespan = max((t[-1][1] for t in timeline.values() if t), default=0.0)
    busy = sum(end - start for t in timeline.values() for start, end, _ in t)
    bubble = 1.0 - busy / (num_ranks * makespan) if makespan > 0 else 0.0
    return Simulation(
        makespan=makespan,
        bubble_fraction=bubble,
        peak_activations={r: _peak_activations(order[r]) for r in order},
        timeline=timeline,
        num_ranks=num_ranks,
        costs={k.value: v for k, v in cost.items() if k.is_compute},
    )
