"""Event simulation of a pipeline order: when each action runs, and what it costs.

Sits after order generation (and optionally lowering) in the schedule layer:
``orders.* -> simulate`` gives makespan, bubble fraction and peak activation
count per rank without any tensors or process group. Rendering of the result
(text, rich, SVG, HTML) lives in :mod:`pippy_split.schedule.render`.

Model: every rank runs its list in order (``None`` steps are skipped, so idle
time comes only from waiting); an action starts at ``max(rank free, inputs
ready)``. Compute-only orders take their inputs from :mod:`.deps` and run on
:mod:`.event_loop`. Lowered orders (with SEND/RECV) follow the batch rule of
:mod:`.actions`, as NCCL runs them, on :mod:`.batch_loop`: a batch is posted
once the rank reaches it and its previous batch has completed; it completes once
every message in it has its counterpart posted (plus ``comm_latency``); a compute
action does not wait for a batch unless it consumes a message that batch
receives. ``BatchRun`` and ``run_batches`` are re-exported from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence, overload

from . import event_rounds
from .actions import Action, ActionKind, Order
from .batch_loop import BatchRun, run_batches
from .decode_order import DecodeCosts, DecodeOrder, DecodeSimulation, is_decode_order, simulate_decode
from .deps import DepIndex, Link, chain_links
from .errors import deadlock_message
from .event_loop import (
    CODE,
    DEFAULT_COSTS,
    CostSpec,
    Encoded,
    LoopRun,
    LoweredOrder,
    encode,
    held_peaks,
    kind_summary,
    latency_fn,
    per_stage,
    requirement_table,
    run_loop,
    stage_cost_table,
    stopped_at,
)
from .messages import peer_table
from .orders.common import gc_paused
from .placement import placement_of_order

__all__ = ["Simulation", "simulate", "DEFAULT_COSTS", "CostSpec", "stage_cost_table", "BatchRun", "run_batches"]


PerStage = Mapping[int, float] | Sequence[float] | None
"""A figure per stage: a list, or ``{stage: figure}``; ``None``: not given."""


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
    num_ranks: int
    costs: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_COSTS))
    """Cost per action kind used (``B`` included); with per-stage costs, stage 0's."""
    peak_bytes: dict[int, float] | None = None
    """Per rank, the most activation bytes held at once (``activation_bytes`` of each
    stage from its F until its backward ends, plus ``workspace_bytes`` while a
    backward runs); ``None`` when :func:`simulate` got no ``activation_bytes``."""
    _timeline: dict[int, list[tuple[float, float, Action]]] | None = field(default=None, repr=False)
    _build: Callable[[], dict[int, list[tuple[float, float, Action]]]] | None = field(default=None, repr=False)

    @property
    def timeline(self) -> dict[int, list[tuple[float, float, Action]]]:
        """Per rank, ``(start, end, action)`` in execution order (built on first use)."""
        if self._timeline is None:
            self._timeline = self._build() if self._build is not None else {}
        return self._timeline

    def __str__(self) -> str:
        return _render().render_text(self)

    def __rich__(self):  # noqa: ANN204 - rich renderable, type depends on render
        return _render().render_rich(self)

    def to_svg(self, path: str | None = None, title: str | None = None) -> str:
        """SVG timeline, one row per rank, under ``title`` (e.g. the schedule and its sizes)
        beside the makespan and bubble; also written to ``path`` when given.

        Example:
            >>> from pippy_split.schedule import get_schedule_class
            >>> order = get_schedule_class("ZBVZeroBubble").compute_order(num_ranks=2, n_microbatches=4)
            >>> svg = simulate(order).to_svg(title="ZBVZeroBubble, 2 ranks, 4 mb")  # path: also write it
            >>> svg.startswith("<svg"), "ZBVZeroBubble, 2 ranks, 4 mb" in svg
            (True, True)
        """
        return _render().render_svg(self, path, title=title)

    def _repr_html_(self) -> str:
        return _render().render_html(self)


def _render() -> ModuleType:
    """:mod:`.render`, imported when a simulation is first drawn: it imports ``rich``,
    which nothing that only simulates needs (the import is not there to dodge a cycle:
    render imports nothing from here)."""
    from . import render

    return render


@overload
def simulate(
    order: Order,
    costs: CostSpec = None,
    *,
    links: Iterable[Link] | None = None,
    comm_latency: float | Mapping[tuple[int, int], float] = 0.0,
    activation_bytes: PerStage = None,
    workspace_bytes: Mapping[Any, float] | Sequence[float] | None = None,
    input_grad_bytes: PerStage = None,
    microbatch_scale: Sequence[float] | None = None,
) -> Simulation: ...


@overload
def simulate(order: DecodeOrder, costs: DecodeCosts = None, *,
             comm_latency: float | Mapping[tuple[int, int], float] = 0.0,
             microbatch_scale: Sequence[float] | None = None) -> DecodeSimulation: ...


def simulate(order: Any, costs: Any = None, *, links: Iterable[Link] | None = None,
             comm_latency: float | Mapping[tuple[int, int], float] = 0.0, activation_bytes: PerStage = None,
             workspace_bytes: Mapping[Any, float] | Sequence[float] | None = None,
             input_grad_bytes: PerStage = None, microbatch_scale: Sequence[float] | None = None,
             ) -> Simulation | DecodeSimulation:
    """Simulate ``order`` and report makespan, bubble and activation memory.

    Args:
        order: ``{rank: [Action | None, ...]}``, compute-only or lowered; or a lowered decode
            order (:mod:`.decode_order`, what ``generate`` runs, on the same batch-rule loop),
            ``costs`` then what a stage's decode step costs (:data:`~.decode_order.DecodeCosts`:
            a number, ``{"D": t, "prefill": t0}``, per ``(stage, kind)``, or a function; default
            1), ``comm_latency`` each message's, ``microbatch_scale`` each lane's.
        costs: time per kind, keys among ``F``, ``I``, ``W`` (default 1 each) and ``B``
            (default ``I + W``); or per stage and kind, ``{(stage, "F"): t}`` (missing pairs
            take the kind's value); or a function ``(stage, kind) -> t``. SEND/RECV cost 0.
        links: ``(src, dst, carries_grad)`` stage links; default the linear chain
            over ``max stage + 1`` stages.
        comm_latency: added when a value crosses ranks: one number, or per link
            ``{(src_stage, dst_stage): t}`` (the gradient back takes the same time).
        activation_bytes: per stage (list or ``{stage: bytes}``), what one microbatch
            holds from its F until its backward ends (B, or W); gives ``peak_bytes``.
        workspace_bytes: per stage, extra bytes while one of its backwards (B or I)
            runs (e.g. activations recomputed under checkpointing); or per stage and
            kind, ``{(stage, "I"): bytes, (stage, "B"): bytes}``.
        input_grad_bytes: per stage, what a split backward keeps from its I until its
            W (the output gradients of the ops W differentiates).
        microbatch_scale: each microbatch's size relative to the one the costs and bytes describe
            (e.g. its tokens over the traced example's): multiplies its times, latencies and bytes.

    Returns:
        A :class:`Simulation`; a :class:`~.decode_order.DecodeSimulation` for a decode order.

    Raises:
        ValueError: when no rank can progress (deadlock), naming each stuck
            rank, its step and the action it waits for.

    Example:
        >>> from pippy_split.schedule.orders import get_order_spec
        >>> sim = simulate(get_order_spec("1F1B").compute_order(4, 8))
        >>> sim.makespan, round(sim.bubble_fraction, 3)
        (33.0, 0.273)
        >>> sim = simulate(get_order_spec("1F1B").compute_order(2, 4), {(1, "F"): 3}, activation_bytes=[10, 20])
        >>> sim.makespan, sim.peak_bytes
        (23.0, {0: 20.0, 1: 20.0})
        >>> simulate(get_order_spec("1F1B").compute_order(2, 2), microbatch_scale=[2, 1]).makespan  # unscaled: 9.0
        14.0
        >>> from pippy_split.schedule.decode_order import decode_order, lower_decode
        >>> decode = lower_decode(decode_order({0: 0, 1: 1}, lanes=2, rounds=8), {0: 0, 1: 1}, links={1: {0}},
        ...                       token_readers={0})
        >>> round(simulate(decode).bubble_fraction, 3), simulate(decode, {"D": 2.0}).makespan
        (0.059, 34.0)
        >>> sim = simulate(decode, {(0, "D"): 2.0, (1, "D"): 1.0, "prefill": 4.0}, comm_latency=0.5)
        >>> sim.makespan, {r: round(b, 2) for r, b in sim.busy.items()}
        (47.0, {0: 0.77, 1: 0.47})
    """
    if is_decode_order(order):
        return simulate_decode(order, costs, comm_latency=latency_fn(comm_latency), lane_scale=microbatch_scale)
    return _simulate_training(order, Pricing(costs, links, latency_fn(comm_latency), activation_bytes, workspace_bytes,
                                             input_grad_bytes, _checked_scale(order, microbatch_scale)))


@dataclass(frozen=True)
class Pricing:
    """What :func:`simulate` prices a training order with, as it got them (see its Args); ``latency`` made a
    function of the stage pair, ``scale`` checked against the order's microbatches."""

    costs: CostSpec
    links: Iterable[Link] | None
    latency: Callable[[int, int], float]
    activation_bytes: PerStage
    workspace_bytes: Mapping[Any, float] | Sequence[float] | None
    input_grad_bytes: PerStage
    scale: list[float] | None


def _simulate_training(order: Order, p: Pricing) -> Simulation:
    """A training order on the engine that fits it: a big compute-only order in rounds over tensors
    (:mod:`.event_rounds`), another compute-only one on the event loop, a lowered one (SEND/RECV) under the
    batch rule."""
    try:
        if event_rounds.worth_it(order):  # many ranks: the same loop in rounds over tensors
            with gc_paused():
                return _simulate_rounds(order, event_rounds.pack_order(order), p)
        enc = encode(order)
    except LoweredOrder:  # a SEND/RECV: a lowered order, run under the batch rule
        return _simulate_batches(order, p)
    return _simulate_compute(order, enc, p)


def _simulate_compute(order: Order, enc: Encoded, p: Pricing) -> Simulation:
    """A compute-only order (``enc``, its integer form) on the event loop (see the module docstring)."""
    num_stages, scale = enc.num_stages, p.scale
    table = stage_cost_table(p.costs, num_stages)
    where = placement_of_order(order)
    run = run_loop(enc, _requirements(p.links, num_stages, where, enc.num_mb, p.latency), table, scale)
    if run.blocked:
        raise ValueError(deadlock_message(order, stopped_at(enc, order, run), where, short=True))
    makespan = max((run.free[r] for r in enc.ranks if enc.keys[r]), default=0.0)
    M = enc.num_mb
    busy = sum(table[k // M] * (1.0 if scale is None else scale[k % M]) for r in enc.ranks for k in enc.keys[r])
    return _finish(order, enc, makespan, busy, table, p, lambda: _timeline(order, enc, run, table, scale))


def _requirements(links: Iterable[Link] | None, num_stages: int, where: dict[int, int], num_mb: int,
                  latency: Callable[[int, int], float]) -> list[list[tuple[int, float]]]:
    link_list = chain_links(num_stages) if links is None else list(links)
    return requirement_table(DepIndex(link_list, num_stages), where, num_mb, latency)


def _simulate_rounds(order: Order, packed: event_rounds.Packed, p: Pricing) -> Simulation:
    """:func:`_simulate_compute` for a big order (``packed``, its tensor form), in rounds
    (:mod:`.event_rounds`): the same numbers; the Python lists are made only when asked for."""
    num_stages, scale = packed.num_stages, p.scale
    table = stage_cost_table(p.costs, num_stages)
    where = event_rounds.placement(packed)
    where = placement_of_order(order) if where is None else where  # None: a conflict, named there
    req = _requirements(p.links, num_stages, where, packed.num_mb, p.latency)
    run = event_rounds.run_rounds(packed, req, table, scale) or run_loop(packed.enc, req, table, scale)
    if run.blocked:
        raise ValueError(deadlock_message(order, stopped_at(packed.enc, order, run), where, short=True))
    sizes = dict(zip(packed.ranks, packed.lengths.tolist()))
    makespan = max((run.free[r] for r in packed.ranks if sizes[r]), default=0.0)
    busy = event_rounds.busy_time(packed, table, scale)
    return _finish(order, packed, makespan, busy, table, p, lambda: _timeline(order, packed.enc, run, table, scale),
                   event_rounds.count_peaks(packed))


def _checked_scale(order: Order, scale: Sequence[float] | None) -> list[float] | None:
    if scale is None:
        return None
    n_mb = 1 + max((a.mb for acts in order.values() for a in acts if a is not None), default=-1)
    values = [float(v) for v in scale]
    if len(values) != n_mb or any(not v > 0 for v in values):
        raise ValueError(f"microbatch_scale needs one positive number per microbatch ({n_mb}), got {list(scale)}")
    return values


def _finish(order: Order, enc: Encoded | event_rounds.Packed, makespan: float, busy: float, table: list[float],
            p: Pricing, build: Callable, counts: Mapping[int, float] | None = None) -> Simulation:
    S, scale = enc.num_stages, p.scale
    ones, zeros = [1.0] * S, [0.0] * S
    if counts is None:
        counts = held_peaks(_plain(enc), ones + zeros * 3, zeros * 2 + ones * 2)  # F holds one, W or B frees it
    held = per_stage(p.activation_bytes, S)
    peak_bytes = None
    if held is not None:
        grads = per_stage(p.input_grad_bytes, S) or zeros
        extra = None
        if p.workspace_bytes is not None:  # only while a backward that rebuilds or reads them runs (B or I)
            work_i, work_b = _per_backward(p.workspace_bytes, S)
            extra = zeros + work_i + zeros + work_b
        add = held + grads + zeros + zeros  # F: activations; I: the output gradients W needs
        release = zeros + zeros + [h + g for h, g in zip(held, grads)] + held
        peak_bytes = held_peaks(_plain(enc), add, release, extra, scale)
    num_ranks = len(order)
    return Simulation(
        makespan=makespan,
        bubble_fraction=1.0 - busy / (num_ranks * makespan) if makespan > 0 else 0.0,
        peak_activations={r: int(counts[r]) for r in order},
        num_ranks=num_ranks,
        costs=kind_summary(table, S),
        peak_bytes=peak_bytes,
        _build=build,
    )


def _plain(enc: Encoded | event_rounds.Packed) -> Encoded:
    return enc.enc if isinstance(enc, event_rounds.Packed) else enc


def _per_backward(values: Mapping[Any, float] | Sequence[float], num_stages: int) -> tuple[list[float], list[float]]:
    """Per-stage workspace of I and of B: ``{(stage, kind): bytes}`` or one figure per stage for both."""
    if isinstance(values, Mapping) and any(isinstance(k, tuple) for k in values):
        return ([float(values.get((s, "I"), 0.0)) for s in range(num_stages)],
                [float(values.get((s, "B"), 0.0)) for s in range(num_stages)])
    both = per_stage(values, num_stages) or [0.0] * num_stages
    return both, both


def _timeline(order: Order, enc: Encoded, run: LoopRun, table: list[float], scale: list[float] | None) -> dict:
    out, M = {}, enc.num_mb
    for r in enc.ranks:
        acts = [a for a in order[r] if a is not None]
        out[r] = [(s, s + table[k // M] * (1.0 if scale is None else scale[k % M]), a)
                  for s, k, a in zip(run.starts[r], enc.keys[r], acts)]
    return out


def _simulate_batches(order: Order, p: Pricing) -> Simulation:
    """A lowered order under the batch rule (see the module docstring)."""
    num_stages = max((a.stage + 1 for acts in order.values() for a in acts if a is not None), default=0)
    table = stage_cost_table(p.costs, num_stages)
    links = chain_links(num_stages) if p.links is None else list(p.links)
    S = num_stages

    def cost(stage: int, kind: ActionKind) -> float:
        return table[CODE[kind._value_] * S + stage]

    where = placement_of_order(order)
    run = run_batches(order, peer_table(num_stages, links, where), cost, p.latency, p.scale)
    if run.blocked:
        raise ValueError(deadlock_message(order, run.stuck(), where, short=True))
    compute = {r: [a if a is not None and a.kind.is_compute else None for a in acts] for r, acts in order.items()}
    enc = encode(compute, num_stages)
    makespan = max((t[-1][1] for t in run.timeline.values() if t), default=0.0)
    busy = sum(end - start for t in run.timeline.values() for start, end, _ in t)
    return _finish(order, enc, makespan, busy, table, p, lambda: run.timeline)
