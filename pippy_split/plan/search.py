"""The planner's search: split x schedule family x stages per rank x microbatches x
checkpointing, each candidate simulated from measured per-stage costs.

Sits on top of the split layer (:mod:`.costs` prices a split) and the schedule layer
(order generators, :func:`~pippy_split.schedule.simulate`); its result,
:class:`~pippy_split.plan.report.Plan`, builds the chosen schedule with
:func:`~pippy_split.schedule.schedules.build_schedule`.

Each candidate is simulated by :func:`~.predict.predict_candidate` (:mod:`.predict`: its family's
order with its split's per-stage times, link times and held bytes; its predicted step
time and per-rank peak).

Measuring (``plan(measure=True)``, the default): after a search with the sums of the
profiled ops, the contenders (candidates within :data:`CONTENDER_WINDOW` of the fastest,
on at most :data:`MEASURED_SPLITS` splits) have their splits' stages run and timed
(:mod:`.measure`: each action kind as the contenders run it, at up to three microbatch
sizes), repeating steps until each split's timings settle (two halves of the samples
agree within 1%) or ``measure_budget`` is spent, and are simulated again with those
times. A measured candidate's ``spread`` is how far its prediction moves between the
halves; where the fastest candidates' spreads stay over 5% the plan is ``too_noisy`` and
says so. Op sums alone come out optimistic (see :data:`CONTENDER_WINDOW`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterable, Sequence

import torch

from ..checkpoint.comm import Comm
from ..schedule.orders import ORDERS, get_order_spec
from ..split.errors import SplitError
from ..split.profile import DEFAULT_PASSES, op_overhead, op_profiles
from ..split.trace import trace_model
from ..stage.groups import GroupArg
from .candidate import Candidate
from .costs import CommModel, SplitCosts, parse_bytes, price_split
from .measure import SplitMeasure, group_of_one, measure_split
from .predict import predict_candidate
from .report import Plan, PlanError

__all__ = ["plan", "predict_candidate"]

PROFILE_PASSES = DEFAULT_PASSES
"""Whole-graph profiling passes (the first warms up; each op keeps its least time)."""

MEASURED_SPLITS = 3
"""``measure=True`` measures at most this many splits (those of the fastest candidates)."""

CONTENDER_WINDOW = 0.3
"""Candidates predicted (by op sums) within this of the fastest are measured: op sums come
out optimistic, by less than this (benchmarks/results/comment_figures.md), so one further
behind would not win."""

MIN_RESOLUTION = 0.01
"""Predictions closer than this (relative) are ties, however quiet the machine was."""

PLAN_MEASURE_BUDGET_S = 20.0
"""Seconds ``measure=True`` may spend repeating steps until the timings settle, shared by
the measured splits (beyond the few steps each takes anyway)."""

ADAM_STATE = 2.0
"""Optimizer state per parameter byte by default (Adam: two moments)."""


def plan(model: torch.nn.Module, example_args: tuple | Any, *, num_ranks: int, memory_budget: str | float,
         loss_fn: Callable | None, global_batch: int, schedules: Sequence[str] | None = None,
         activation_checkpoint: Iterable[bool] = (False, True), stages_per_rank: Iterable[int] = (1, 2),
         microbatches: Iterable[int] | None = None, balance: Iterable[str] = ("time",), comm: CommModel | None = None,
         optimizer_state: float = ADAM_STATE, example_kwargs: dict | None = None, example_target: Any = None,
         profile_passes: int = PROFILE_PASSES, measure: bool | int = True, measure_budget: float = PLAN_MEASURE_BUDGET_S,
         resolution: float = MIN_RESOLUTION, group: GroupArg = None) -> Plan:
    """Choose split, schedule, stages per rank, microbatches and checkpointing for ``model``.

    Profiles ``model`` once on ``example_args``, prices every split and simulates every
    candidate, then measures the contenders (see the module docstring).

    Args:
        model: the model (not modified).
        example_args: one microbatch of inputs (batch in dim 0).
        num_ranks: pipeline ranks.
        memory_budget: per-rank bytes (a number, or ``"2GB"``, ``"40GiB"``).
        loss_fn: the loss the schedules will use (kept for ``plan.best.build_schedule``).
        global_batch: samples per step; a candidate's microbatch is ``global_batch / m``.
        schedules: families to try (default all of ``ORDERS``).
        activation_checkpoint: settings to try (``True`` = ``activation_checkpoint="full"``).
        stages_per_rank: tried for families that take any count (others use theirs).
        microbatches: ``m`` values to try, each dividing ``global_batch`` (default its
            divisors from ``num_ranks`` to ``8 x num_ranks``, or the three largest below).
        balance: cost models whose balanced split is tried ("time", "memory", ...).
        comm: link model; default measured on the current process group when one is
            initialised, else :class:`CommModel`'s defaults.
        optimizer_state: optimizer bytes per parameter byte (2 for Adam, 0 for SGD).
        example_kwargs: keyword inputs of the example microbatch.
        example_target: the example microbatch's target: with it, the stages are measured
            with ``loss_fn``; without, with the mean of the outputs as the loss.
        profile_passes: whole-graph profiling passes (more resist a busy machine better).
        measure: run and time the contenders' stages and simulate them again (on at most
            :data:`MEASURED_SPLITS` splits, or this many if an int); ``False``: op sums only.
        measure_budget: seconds the measurement may spend repeating steps until each
            split's timings settle, shared by the measured splits.
        resolution: relative step-time difference always a tie (overlapping spreads tie too).
        group: the pipeline's process group or DeviceMesh dimension (``mesh["pp"]``): the
            default link model is measured between its first two ranks. Every rank of
            the default group calls ``plan()`` and gets rank 0's plan.

    Returns:
        A :class:`Plan`: candidates fitting the budget ranked by predicted step time.

    Raises:
        PlanError: nothing fits; says the smallest predicted peak and what to change.

    Example:
        >>> import pippy_split as ps
        >>> from pippy_split import zoo
        >>> entry = zoo.get("mlp_stack", d=16)  # 8 layers, batch 8
        >>> plan = ps.plan(entry.model, (entry.args[0][:2],), num_ranks=2, memory_budget="1GB",
        ...                loss_fn=entry.loss_fn, global_batch=8, schedules=["1F1B", "GPipe"])
        >>> plan.best.schedule in ("1F1B", "GPipe"), plan.best.fits  # print(plan): the candidates' table
        (True, True)
        >>> sched = plan.best.build_schedule(group=group)  # on every rank  # doctest: +SKIP
    """
    return _plan(model, example_args, num_ranks, memory_budget, loss_fn, global_batch, schedules,
                 activation_checkpoint, stages_per_rank, microbatches, balance, comm, optimizer_state, example_kwargs,
                 example_target, profile_passes, measure, measure_budget, resolution, group)


def _plan(model: torch.nn.Module, example_args: tuple | Any, num_ranks: int, memory_budget: str | float,
          loss_fn: Callable | None, global_batch: int, schedules: Sequence[str] | None,
          activation_checkpoint: Iterable[bool], stages_per_rank: Iterable[int], microbatches: Iterable[int] | None,
          balance: Iterable[str], comm: CommModel | None, optimizer_state: float, example_kwargs: dict | None,
          example_target: Any, profile_passes: int, measure: bool | int, measure_budget: float, resolution: float,
          group: GroupArg) -> Plan:
    """:func:`plan`'s steps, its arguments in its order: check them, trace and profile the model
    once, search, measure the contenders, rank."""
    if num_ranks < 1 or global_batch < 1:
        raise ValueError(f"plan() needs num_ranks >= 1 and global_batch >= 1, got {num_ranks}, {global_batch}")
    budget = parse_bytes(memory_budget)
    example_args = example_args if isinstance(example_args, tuple) else (example_args,)
    b0 = _batch_size(example_args)
    names = _schedule_names(schedules)
    comm = comm if comm is not None else _default_comm(group)
    traced = trace_model(model, example_args, example_kwargs)
    flat = traced.flatten_inputs(example_args, example_kwargs or {})
    ms = _microbatch_counts(microbatches, global_batch, num_ranks)
    grid = itertools.product(names, sorted(set(stages_per_rank)), list(balance))
    notes: list[str] = []
    overhead = _agree_profile(traced, model, flat, profile_passes)
    acs = [bool(a) for a in activation_checkpoint]
    price = functools.partial(price_split, traced, model, flat, overhead=overhead,
                              example=(example_args, example_kwargs or {}), batch=b0, passes=profile_passes)
    candidates = _search(price, grid, ms, acs, num_ranks, global_batch / b0, comm, optimizer_state, budget, notes)
    if measure and candidates:
        measure_one = functools.partial(measure_split, loss_fn=loss_fn, example_target=example_target,
                                        group=group_of_one())
        limit = MEASURED_SPLITS if measure is True else int(measure)
        candidates = _measure_contenders(candidates, measure_one, limit, num_ranks, global_batch / b0, comm,
                                         optimizer_state, budget, measure_budget)
    if not candidates:
        raise PlanError(f"plan(): no candidate could be built for {num_ranks} ranks: " + "; ".join(notes or ["-"]))
    result = Plan(candidates, budget, comm, loss_fn, num_ranks, global_batch, notes, resolution)
    if not result.fitting:
        raise PlanError(result.no_fit_message())
    return result


def _schedule_names(schedules: Sequence[str] | None) -> list[str]:
    """The families to try (default every one of ``ORDERS``); an unknown name is refused
    before anything runs."""
    names = list(schedules) if schedules is not None else list(ORDERS)
    for name in names:
        get_order_spec(name)
    return names


def _microbatch_counts(microbatches: Iterable[int] | None, global_batch: int, num_ranks: int) -> list[int]:
    """The ``m`` values to try, sorted (default :func:`_default_microbatches`); ``ValueError``
    unless each divides ``global_batch`` (a traced microbatch has a fixed size)."""
    ms = sorted(set(microbatches)) if microbatches is not None else _default_microbatches(global_batch, num_ranks)
    uneven = [m for m in ms if m < 1 or global_batch % m]
    if uneven:
        raise ValueError(f"plan(): microbatches {uneven} do not divide global_batch={global_batch}; a traced "
                         f"microbatch has a fixed size. Divisors: "
                         f"{[m for m in range(1, global_batch + 1) if global_batch % m == 0][:16]}")
    return ms


def _measure_contenders(candidates: list[Candidate], measure: Callable[..., SplitMeasure], limit: int,
                        num_ranks: int, batches: float, comm: CommModel, optimizer_state: float,
                        budget: float, seconds: float = PLAN_MEASURE_BUDGET_S) -> list[Candidate]:
    """Measure the splits of the fastest candidates (by op sums: the contenders, within
    :data:`CONTENDER_WINDOW` of the fastest; up to ``limit`` splits, ``seconds`` of
    repeating steps shared among them), each only as its contenders run it (checkpointed
    or not, split backward or not, their microbatch sizes), and simulate those candidates
    again with the measured times, and with each half of the samples for their
    ``spread``; the others keep their op sums. Inside a process group every rank measures
    at once and keeps rank 0's figures."""
    ranked = sorted(candidates, key=lambda c: (not c.fits, c.step_time))
    fastest = ranked[0].step_time
    contenders: dict[int, list[Candidate]] = {}
    for c in ranked:
        if c.step_time > fastest * (1 + CONTENDER_WINDOW):
            break
        if id(c.split) in contenders or len(contenders) < limit:
            contenders.setdefault(id(c.split), []).append(c)
    for group in contenders.values():
        split = group[0].split
        pairs = {(c.activation_checkpoint, get_order_spec(c.schedule).split_backward) for c in group}
        sizes = [c.n_microbatches for c in group]
        split.measured = _rank0(measure(
            split, activation_checkpoint=sorted({ac for ac, _ in pairs}),
            split_backward=sorted({sb for _, sb in pairs}), only=pairs,
            batch_range=(split.batch * batches / max(sizes), split.batch * batches / min(sizes)),
            budget_s=seconds / len(contenders)))
    out = []
    for c in candidates:
        measured = c.split.measured
        if measured is None or not measured.has(c.activation_checkpoint, get_order_spec(c.schedule).split_backward):
            out.append(c)  # its op-sum simulation stands
            continue
        simulate_with = functools.partial(predict_candidate, schedule=c.schedule, num_ranks=num_ranks, m=c.n_microbatches,
                                          ac=c.activation_checkpoint, scale=batches / c.n_microbatches, comm=comm,
                                          optimizer_state=optimizer_state, budget=budget)
        again = simulate_with(c.split)
        if again is None:
            out.append(c)
            continue
        again.spread = _spread(again, simulate_with)
        out.append(again)
    return out


def _spread(cand: Candidate, simulate_with: Callable[[SplitCosts], Candidate | None]) -> float | None:
    """How far ``cand``'s predicted step time moves between the two halves of its split's
    measured samples, relative to it (None without halves)."""
    measured = cand.split.measured
    if measured is None or len(measured.halves) != 2:
        return None
    times = []
    for i in (0, 1):
        half = simulate_with(dataclasses.replace(cand.split, measured=measured.half(i)))
        if half is None:
            return None
        times.append(half.step_time)
    return abs(times[0] - times[1]) / cand.step_time if cand.step_time > 0 else 0.0


def _rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank of the default group, over the numpy-free object broadcast
    (torch's ``broadcast_object_list`` decodes with numpy, which torch does not install)."""
    return Comm(no_dist=False).broadcast(value)


def _search(price: Callable[..., SplitCosts], grid: Iterable[tuple[str, int, str]], ms: list[int], acs: list[bool],
            num_ranks: int, batches: float, comm: CommModel, optimizer_state: float, budget: float,
            notes: list[str]) -> list[Candidate]:
    """Every (family, stages per rank, split metric) of ``grid`` x m x AC, each split priced
    once; ``batches`` is the global batch in example microbatches."""
    splits: dict[tuple[str, int], SplitCosts | None] = {}
    seen: set[tuple] = set()
    out: list[Candidate] = []
    for name, spr, metric in grid:
        spec = get_order_spec(name)
        spr = spec.stages_per_rank if spec.stages_per_rank is not None else max(spr, spec.min_stages_per_rank)
        key = (metric, spr * num_ranks)
        if key not in splits:
            try:
                splits[key] = _unless_priced(price(spr * num_ranks, metric), splits, notes)
            except (SplitError, ValueError) as e:  # too few pieces to cut: note it, try the rest
                notes.append(f"{spr * num_ranks} stages by {metric}: {e}")
                splits[key] = None
        split = splits[key]
        if split is None:
            continue
        for m, ac in itertools.product(ms, acs):
            cand = predict_candidate(split, spec.name, num_ranks, m, ac, batches / m, comm, optimizer_state, budget)
            if cand is not None and cand.key not in seen:
                seen.add(cand.key)
                out.append(cand)
    return out


def _unless_priced(split: SplitCosts, splits: dict[tuple[str, int], SplitCosts | None],
                   notes: list[str]) -> SplitCosts | None:
    """``split``, or None where another metric already cut at the same places (its
    candidates would be the same rows again)."""
    same = next((other for other in splits.values() if other is not None and other.positions == split.positions),
                None)
    if same is None:
        return split
    notes.append(f"{split.num_stages} stages by {split.metric}: the same cuts as by {same.metric}")
    return None


def _batch_size(args: tuple) -> int:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    raise ValueError("plan() needs a tensor with a batch dimension (dim 0) among example_args, to scale costs to "
                     "each candidate's microbatch size")


def _default_microbatches(global_batch: int, num_ranks: int) -> list[int]:
    divisors = [m for m in range(1, global_batch + 1) if global_batch % m == 0]
    ms = [m for m in divisors if num_ranks <= m <= 8 * num_ranks]
    return ms or [m for m in divisors if m <= 8 * num_ranks][-3:]


def _agree_profile(traced: Any, model: torch.nn.Module, flat: Sequence[Any], passes: int) -> tuple:
    """Profile once; inside a process group every rank takes rank 0's figures, so that every
    rank cuts and ranks candidates alike (``plan.best`` is the same pipeline everywhere).
    Returns the per-op overhead ``(F, I, W)``."""
    profs, overhead = _rank0((op_profiles(traced, model, flat, passes), op_overhead()))
    traced.__dict__["_op_profiles"][passes] = profs
    return overhead


def _default_comm(group: GroupArg = None) -> CommModel:
    """The link model measured on ``group`` (the default group when None); with a
    pipeline group inside a larger world, every rank takes rank 0's measurement."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return CommModel.measure() if group is None else _rank0(CommModel.measure(group))
    return CommModel()
