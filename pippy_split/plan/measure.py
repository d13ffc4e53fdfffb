"""Each stage's action times and held bytes, measured by running the split's own stages.

The planner's second measurement (the first, :func:`pippy_split.split.profile.op_profiles`,
times ops one by one and is what splits are balanced by). For a split that may win, its
stages are built on the model's device, all on this process, and run through the real
runtime (:class:`~pippy_split.schedule.ScheduleFromOrder`, one rank), microbatch after
microbatch through every stage: F then B, twice, with plain stages; F, I, W, then F, B,
then F, I, W with stages that split their backward (a zero-bubble family runs both). ``timed_actions`` times each action;
:class:`~.saved_bytes.SavedBytes` counts what autograd holds around it. So what a stage
costs includes what summing its ops leaves out: the runtime's work per action, the
split backward's bookkeeping, the recompute of checkpointing and how ops run one
after another rather than alone. Each action starts from a cold cache
(:data:`FLUSH_BYTES` are written before it), as in a pipeline.

Steps are repeated until the timings settle: the recorded steps alternate between two
halves, and measuring stops once each half's least times agree (:func:`half_gap` at most
``target``, 1% by default), or ``budget_s`` seconds have passed, or ``max_passes`` steps
were recorded (:func:`repeat_until_steady`). The halves are kept: simulating a candidate
with each half's times says how far its prediction moves with timing noise (the
planner's ties and its "too noisy" verdict, :mod:`.report`).

Each action is measured at the example's microbatch size and at half and twice it
(those within the sizes the planner will price); between them its time is interpolated
linearly, beyond them the nearest segment is extended (an op's time is not linear in
the microbatch: fixed costs dominate small ones). Bytes are per sample. The model is
left as it was (gradients, buffers, random state). Cost: about 50 forward+backward
passes of the whole model on the example microbatch per split where the timings settle
at once; on a busy machine more, up to ``budget_s`` seconds.

Example:
    >>> from pippy_split.plan.costs import price_split
    >>> from pippy_split.split.trace import trace_model
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    >>> x = torch.randn(4, 8)  # the example microbatch: 4 samples
    >>> traced = trace_model(model, (x,))
    >>> costs = price_split(traced, model, traced.flatten_inputs((x,), {}), 2, example=((x,), {}), batch=4)
    >>> m = measure_split(costs, only=[(False, True)], budget_s=0.0)  # split backward, no checkpointing
    >>> m.sizes, m.passes, m.stage(ac=False, split_backward=True, stage=0).kinds  # budget 0: two recorded steps
    ((2, 4, 8), 2, ['F', 'I', 'W', 'B'])
    >>> m.stage(ac=False, split_backward=True, stage=0).time("W", 4) > 0  # seconds of one W on 4 samples
    True
"""

from __future__ import annotations

import bisect
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch

from ..stage.groups import GroupArg
from .measured_run import MeasuredRun

__all__ = ["StageMeasure", "SplitMeasure", "measure_split", "group_of_one", "half_gap", "repeat_until_steady",
           "DEFAULT_MEASURE_PASSES", "SPREAD_TARGET", "MAX_MEASURE_PASSES", "MEASURE_BUDGET_S"]

DEFAULT_MEASURE_PASSES = 4
"""Steps per measured schedule at least: two warm up (the allocator settles: with one, the
first schedule measured in a process ran slow), then one step for each half of the
samples; each action keeps its least time."""

WARMUP_PASSES = 2

SPREAD_TARGET = 0.01
"""Steps are repeated until the two halves' least times agree this closely (:func:`half_gap`)."""

MAX_MEASURE_PASSES = 24
"""Recorded steps per measured schedule at most, however noisy."""

MEASURE_BUDGET_S = 10.0
"""Seconds one :func:`measure_split` may spend repeating steps beyond the first ones."""

FLUSH_BYTES = 64 * 2**20
"""At most this is written before each measured action, so that it starts from a cold
cache as in a pipeline, where other microbatches' work runs between a microbatch's
actions (measured hot, an action runs faster than it does pipelined). Twice a 32 MiB L3."""


@dataclass(frozen=True)
class StageMeasure:
    """One stage's measured actions.

    Attributes:
        points: per kind ("F", "I", "W", "B"), ``(microbatch size, seconds)`` measured, by size.
        retained_bytes: per sample, the saved bytes an I leaves alive for its W beyond
            those its F saved (under checkpointing: the rebuilt graph W still reads).
        work_bytes: per sample, the most saved bytes a B adds while it runs (under
            checkpointing: the rebuilt graph).
        input_work_bytes: per sample, the most an I adds while it runs beyond what it
            leaves for W.
    """

    points: dict[str, tuple[tuple[int, float], ...]]
    retained_bytes: float = 0.0
    work_bytes: float = 0.0
    input_work_bytes: float = 0.0

    def time(self, kind: str, batch: float) -> float:
        """Seconds of one ``kind`` action on a microbatch of ``batch`` samples (at least 0).

        Example:
            >>> StageMeasure({"F": ((2, 1.0), (4, 1.5))}).time("F", 3), StageMeasure({"F": ((4, 2.0),)}).time("F", 2)
            (1.25, 1.0)
        """
        pts = self.points[kind]
        if len(pts) == 1:
            return pts[0][1] * batch / pts[0][0]
        k = min(max(bisect.bisect_left([b for b, _ in pts], batch), 1), len(pts) - 1)
        (b1, t1), (b2, t2) = pts[k - 1], pts[k]
        return max(t1 + (t2 - t1) * (batch - b1) / (b2 - b1), 0.0)

    @property
    def kinds(self) -> list[str]:
        return list(self.points)


@dataclass(frozen=True)
class SplitMeasure:
    """A split's stages measured with and without checkpointing, plain and split backward."""

    stages: dict[tuple[bool, bool], list[StageMeasure]]
    """``(activation checkpointing, split backward) -> per stage``."""
    sizes: tuple[int, ...]
    seconds: float
    """How long the measurement took."""
    noise: float = 0.0
    """How repeatable the timings were: the largest :func:`half_gap` of the measured
    schedules when measuring stopped (0.01: the two halves' least times summed 1% apart)."""
    halves: tuple[dict[tuple[bool, bool], list[StageMeasure]], ...] = ()
    """``stages`` again from each half of the samples alone (two entries, or none)."""
    passes: int = 0
    """Steps recorded per measured schedule (the fewest of them)."""

    def stage(self, *, ac: bool, split_backward: bool, stage: int) -> StageMeasure:
        return self.stages[(ac, split_backward)][stage]

    def has(self, ac: bool, split_backward: bool) -> bool:
        return (ac, split_backward) in self.stages

    def half(self, i: int) -> SplitMeasure:
        """The measurement as half ``i`` (0 or 1) of the samples alone gave it.

        Example:
            >>> m = SplitMeasure({}, (4,), 1.0, halves=({"a": 1}, {"b": 2}))
            >>> m.half(1).stages
            {'b': 2}
        """
        return SplitMeasure(self.halves[i], self.sizes, self.seconds, self.noise, (), self.passes)


def half_gap(samples: Mapping[Any, tuple[Sequence[float], Sequence[float]]]) -> float:
    """How far apart two halves of the samples put the least times: the sum over keys of
    ``|least of half 0 - least of half 1|`` over the sum of the least times (``inf`` while
    a key lacks a sample in either half). Long actions weigh more than short ones, as in a
    step.

    Example:
        >>> round(half_gap({"F": ([1.0, 1.3], [1.02]), "B": ([2.0], [2.0, 5.0])}), 4)
        0.0067
        >>> half_gap({"F": ([1.0], [])})
        inf
    """
    if any(not a or not b for a, b in samples.values()):
        return float("inf")
    least = sum(min(min(a), min(b)) for a, b in samples.values())
    apart = sum(abs(min(a) - min(b)) for a, b in samples.values())
    return apart / least if least > 0 else 0.0


def repeat_until_steady(step: Callable[[bool], None], gap: Callable[[], float], *, warmup: int = WARMUP_PASSES,
                        least: int = 2, most: int = MAX_MEASURE_PASSES, target: float = SPREAD_TARGET,
                        budget_s: float = MEASURE_BUDGET_S,
                        clock: Callable[[], float] = time.perf_counter) -> int:
    """Run ``step(False)`` ``warmup`` times, then ``step(True)`` at least ``least`` times
    and on until ``gap()`` is at most ``target``, ``budget_s`` seconds (by ``clock``, from
    the first warm-up step) have passed, or ``most`` steps were recorded. Returns the
    recorded steps.

    Example:
        >>> gaps = iter([0.5, 0.2, 0.005])
        >>> repeat_until_steady(lambda record: None, lambda: next(gaps), least=1, target=0.01)
        3
    """
    start = clock()
    for _ in range(warmup):
        step(False)
    recorded = 0
    while True:
        step(True)
        recorded += 1
        if recorded >= least and (recorded >= most or clock() - start >= budget_s or gap() <= target):
            return recorded


@contextlib.contextmanager
def _model_untouched(model: torch.nn.Module) -> Iterator[None]:
    """Gradients, buffers and random state as they were after the block (the stages
    built from a real model's pipe share its tensors)."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [d for d in {p.device for p in model.parameters()} if d.type != "cpu"]
    with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in buffers:
                    b.copy_(value)
            for p, g in grads:
                p.grad = g


def group_of_one() -> Any:
    """Inside a process group, a new group of this rank alone (the measured stages all run
    here); None outside one. Only this rank takes part in making it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return None


def measure_split(costs: Any, *, loss_fn: Callable | None = None, example_target: Any = None,
                  activation_checkpoint: Sequence[bool] = (False, True), split_backward: Sequence[bool] = (False, True),
                  batch_range: tuple[float, float] | None = None,
                  only: Collection[tuple[bool, bool]] | None = None, group: GroupArg = None,
                  passes: int = DEFAULT_MEASURE_PASSES, target: float = SPREAD_TARGET,
                  budget_s: float = MEASURE_BUDGET_S, max_passes: int = MAX_MEASURE_PASSES) -> SplitMeasure:
    """Run ``costs``' split (a :class:`~.costs.SplitCosts`) stage by stage on this process
    and measure every action kind (see the module docstring).

    ``loss_fn`` with ``example_target`` (the example microbatch's target) is the loss of
    the last stage; without a target, the mean of the model's floating outputs.
    ``batch_range``: the smallest and largest microbatch the planner prices; sizes
    outside it are not measured (default: half and twice the example's). ``only``: the
    ``(checkpointing, split backward)`` pairs to measure (default: every combination).
    ``group``: inside a process group, a group of this rank alone (:func:`group_of_one`;
    default: a new one). ``passes`` steps at least (two warm up); more until the two
    halves of the samples agree within ``target`` (:func:`half_gap`), ``budget_s`` seconds
    have passed or ``max_passes`` steps were recorded.

    Example:
        >>> m = measure_split(costs, loss_fn=None, budget_s=5.0)  # doctest: +SKIP
        >>> m.noise, m.passes  # doctest: +SKIP
        (0.004, 3)
    """
    t0 = time.perf_counter()
    model = costs.model
    if model is None:
        raise ValueError("measure_split needs the SplitCosts of a model (price_split keeps it)")
    b0 = costs.batch
    sizes = _sizes(b0, batch_range)
    group = group if group is not None else group_of_one()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    out: dict[tuple[bool, bool], list[StageMeasure]] = {}
    halves: tuple[dict[tuple[bool, bool], list[StageMeasure]], ...] = ({}, {})
    gaps: list[float] = []
    recorded: list[int] = []
    phases = _phases(activation_checkpoint, split_backward, only)
    with _model_untouched(model):
        # plain stages first: the I/W split instruments the (shared) stage modules in place.
        # Within a phase the runs take turns step by step, so a passing disturbance of the
        # machine slows one step of each rather than every step of one.
        for k, (split, acs) in enumerate(phases):
            runs = {(ac, b): MeasuredRun(costs.pipe_for(b), costs.example, b, b0, ac, split, device, group,
                                         loss_fn, example_target, _flush_bytes(costs, b / b0))
                    for ac in acs for b in sizes}
            share = max(budget_s - (time.perf_counter() - t0), 0.0) / (len(phases) - k)  # of what is left
            steps, gap = _settle(runs, least=max(passes - WARMUP_PASSES, 2), most=max_passes, target=target,
                                 budget_s=share)
            recorded.append(steps)
            gaps.append(gap)
            for run in runs.values():
                run.close()
            for ac in acs:
                by_size = {b: runs[(ac, b)] for b in sizes}
                out[(ac, split)] = _fit(by_size, sizes, costs.num_stages, b0)
                for i, half in enumerate(halves):
                    half[(ac, split)] = _fit(by_size, sizes, costs.num_stages, b0, half=i)
    return SplitMeasure(out, sizes, time.perf_counter() - t0, max(gaps, default=0.0), halves, min(recorded, default=0))


def _sizes(b0: int, batch_range: tuple[float, float] | None) -> tuple[int, ...]:
    """The microbatch sizes to measure: ``b0``, and half and twice it where within ``batch_range``."""
    lo, hi = batch_range if batch_range is not None else (b0 / 2, 2 * b0)
    return tuple(sorted({b0} | {b for b in (b0 // 2, 2 * b0) if b >= 1 and lo <= b <= hi}))


def _phases(activation_checkpoint: Sequence[bool], split_backward: Sequence[bool],
            only: Collection[tuple[bool, bool]] | None) -> list[tuple[bool, list[bool]]]:
    """``(split backward, checkpointing settings)`` to measure, plain stages first; none empty."""
    phases = [(split, [ac for ac in activation_checkpoint if only is None or (ac, split) in only])
              for split in sorted(split_backward)]
    return [(split, acs) for split, acs in phases if acs]


def _settle(runs: dict[tuple[bool, int], MeasuredRun], *, least: int, most: int, target: float,
            budget_s: float) -> tuple[int, float]:
    """Step ``runs`` in turn until their timings settle (:func:`repeat_until_steady`); the
    recorded steps and the runs' largest :func:`half_gap` then."""
    def step(record: bool) -> None:
        for run in runs.values():
            run.step(record)

    def gap() -> float:
        return max(half_gap(run.samples) for run in runs.values())

    return repeat_until_steady(step, gap, least=least, most=most, target=target, budget_s=budget_s), gap()



def _flush_bytes(costs: Any, scale: float) -> int:
    """Enough to push the largest stage's working set (its activations and parameters)
    out of the cache twice over, at most :data:`FLUSH_BYTES`: a small model's actions
    need no large write."""
    largest = max(st.held_bytes * scale + st.param_bytes for st in costs.stages)
    return int(min(FLUSH_BYTES, 2 * largest))


def _fit(runs: dict[int, MeasuredRun], sizes: tuple[int, ...], num_stages: int, b0: int,
         half: int | None = None) -> list[StageMeasure]:
    """Each (stage, kind)'s least time at each size (of every sample, or of one half's);
    bytes per sample at the example's size."""
    best = {b: runs[b].best(half) for b in sizes}
    r0 = runs[b0]
    out = []
    for s in range(num_stages):
        points = {kind: tuple((b, best[b][(s, kind)]) for b in sizes)
                  for kind in ("F", "I", "W", "B") if (s, kind) in best[b0]}
        out.append(StageMeasure(points, r0.retained.get(s, 0.0) / b0, r0.work.get((s, "B"), 0.0) / b0,
                                r0.work.get((s, "I"), 0.0) / b0))
    return out
