"""Each stage's action times and held bytes, measured by running the split's own stages.

The planner's second measurement (the first, :func:`pippy_split.split.profile.op_profiles`,
times ops one by one and is what splits are balanced by). Once a split is chosen, its
stages are built on the model's device, all on this process, and run through the real
runtime (:class:`~pippy_split.schedule.ScheduleFromOrder`, one rank): per stage, F then
B for one microbatch with plain stages, and F, I, W then F, B with stages that split
their backward (a zero-bubble family runs both). ``timed_actions`` times each action;
:class:`~.saved_bytes.SavedBytes` counts what autograd holds around it. So what a stage
costs includes what summing its ops leaves out: the runtime's work per action, the
split backward's bookkeeping, the recompute of checkpointing and how ops run one
after another rather than alone.

Two microbatch sizes give each action a fixed part and a part per sample; bytes are
per sample. The model is left as it was (gradients, buffers, random state).

Example:
    >>> m = measure_split(costs, loss_fn=None)  # doctest: +SKIP
    >>> m.stage(ac=False, split_backward=True, stage=0).time("W", 4)  # doctest: +SKIP
    0.0187
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from ..schedule.actions import Action, ActionKind
from ..schedule.schedules import ScheduleFromOrder
from .costs import resize_batch
from .saved_bytes import SavedBytes

__all__ = ["StageMeasure", "SplitMeasure", "measure_split", "DEFAULT_MEASURE_PASSES"]

DEFAULT_MEASURE_PASSES = 3
"""Steps per measured schedule: the first warms up, each action keeps its least time."""


@dataclass(frozen=True)
class StageMeasure:
    """One stage's measured actions.

    Attributes:
        fixed: seconds of each kind ("F", "I", "W", "B") that do not grow with the microbatch.
        per_sample: seconds of each kind per sample of the microbatch.
        retained_bytes: per sample, the saved bytes an I leaves alive for its W beyond
            those its F saved (under checkpointing: the rebuilt graph W still reads).
        work_bytes: per sample, the most saved bytes a B adds while it runs (under
            checkpointing: the rebuilt graph).
        input_work_bytes: per sample, the most an I adds while it runs beyond what it
            leaves for W.
    """

    fixed: dict[str, float]
    per_sample: dict[str, float]
    retained_bytes: float = 0.0
    work_bytes: float = 0.0
    input_work_bytes: float = 0.0

    def time(self, kind: str, batch: float) -> float:
        """Seconds of one ``kind`` action on a microbatch of ``batch`` samples."""
        return self.fixed[kind] + self.per_sample[kind] * batch


@dataclass(frozen=True)
class SplitMeasure:
    """A split's stages measured with and without checkpointing, plain and split backward."""

    stages: dict[tuple[bool, bool], list[StageMeasure]]
    """``(activation checkpointing, split backward) -> per stage``."""
    sizes: tuple[int, ...]
    seconds: float
    """How long the measurement took."""

    def stage(self, *, ac: bool, split_backward: bool, stage: int) -> StageMeasure:
        return self.stages[(ac, split_backward)][stage]

    def has(self, ac: bool, split_backward: bool) -> bool:
        return (ac, split_backward) in self.stages


def _order(num_stages: int, split_backward: bool) -> dict[int, list[Action | None]]:
    """One rank's order, microbatch after microbatch through every stage: F then B, twice;
    split: F, I, W, then F, B, then F, I, W (the first of a kind in a step can pay for
    memory the allocator hands out afresh; each kind keeps its least time)."""
    def forward(mb: int) -> list[Action | None]:
        return [Action(s, ActionKind.F, mb) for s in range(num_stages)]

    def backward(mb: int, kinds: Sequence[ActionKind]) -> list[Action | None]:
        return [Action(s, k, mb) for s in reversed(range(num_stages)) for k in kinds]

    iw, b = [ActionKind.I, ActionKind.W], [ActionKind.B]
    rounds = [iw, b, iw] if split_backward else [b, b]
    return {0: [a for mb, kinds in enumerate(rounds) for a in forward(mb) + backward(mb, kinds)]}


def _surrogate_loss(output: Any, target: Any) -> torch.Tensor:
    """The mean of every floating output: a loss when the user's needs a target we do not have."""
    leaves = [t.float().mean() for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    if not leaves:
        raise ValueError("measuring the stages needs a floating-point model output to differentiate")
    return torch.stack([x.real if x.is_complex() else x for x in leaves]).sum()


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


def _group_of_one() -> Any:
    """Inside a process group, a group of this rank alone (the stages all run here)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return None


def measure_split(costs: Any, *, loss_fn: Callable | None = None, example_target: Any = None,
                  activation_checkpoint: Sequence[bool] = (False, True), split_backward: Sequence[bool] = (False, True),
                  passes: int = DEFAULT_MEASURE_PASSES) -> SplitMeasure:
    """Run ``costs``' split (a :class:`~.costs.SplitCosts`) stage by stage on this process
    and measure every action kind (see the module docstring).

    ``loss_fn`` with ``example_target`` (the example microbatch's target) is the loss of
    the last stage; without a target, the mean of the model's floating outputs.
    """
    t0 = time.perf_counter()
    model = costs.model
    if model is None:
        raise ValueError("measure_split needs the SplitCosts of a model (price_split keeps it)")
    b0 = costs.batch
    sizes = (b0, b0 // 2) if b0 >= 2 else (b0, 2 * b0)
    group = _group_of_one()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    out: dict[tuple[bool, bool], list[StageMeasure]] = {}
    with _model_untouched(model):
        for ac in activation_checkpoint:
            for split in split_backward:
                runs = {b: _measure_run(costs.pipe_for(b), costs.example, b, b0, ac, split, device, group, loss_fn,
                                        example_target, passes) for b in sizes}
                out[(ac, split)] = _fit(runs, sizes, costs.num_stages)
    return SplitMeasure(out, sizes, time.perf_counter() - t0)


def _measure_run(pipe: Any, example: tuple[tuple, dict], batch: int, b0: int, ac: bool, split: bool, device: torch.device, group: Any,
                 loss_fn: Callable | None, example_target: Any, passes: int) -> dict[str, Any]:
    """Least time per (stage, kind) over ``passes - 1`` steps after a warm-up, and, per
    stage, the saved bytes its I leaves for W and the most a backward adds."""
    S = pipe.num_stages
    stages = [pipe.build_stage(s, device, group, activation_checkpoint="full" if ac else None) for s in range(S)]
    order = _order(S, split)
    n_mb = 3 if split else 2
    if loss_fn is not None and example_target is not None:
        target, loss = resize_batch((example_target,), b0, batch * n_mb)[0], loss_fn
    else:
        target, loss = torch.zeros(batch * n_mb, device=device), _surrogate_loss
    args = resize_batch(example[0], b0, batch * n_mb)
    kwargs = dict(zip(example[1], resize_batch(tuple(example[1].values()), b0, batch * n_mb)))
    sched = ScheduleFromOrder(stages, n_mb, loss, order=order)
    params = {p.untyped_storage().data_ptr() for st in stages for p in st.module.parameters()}
    best: dict[tuple[int, str], float] = {}
    retained: dict[int, float] = {}
    work: dict[tuple[int, str], float] = {}
    for k in range(max(passes, 2)):
        counter = SavedBytes(params)

        def probe(c: SavedBytes = counter) -> tuple[int, int]:
            return c.live, c.take_peak()

        with counter.hooks(), sched.timed_actions(probe=probe) as times:
            sched.step(*args, target=target, **kwargs)
        if k == 0:
            continue
        for t in times:
            key = (t.action.stage, t.action.kind.value)
            best[key] = min(best.get(key, float("inf")), t.seconds)
            (live0, _), (live1, peak) = t.before, t.after
            s = t.action.stage
            if t.action.kind is ActionKind.B:
                work[(s, "B")] = max(work.get((s, "B"), 0.0), float(peak - live0))
            if t.action.kind is ActionKind.I:
                work[(s, "I")] = max(work.get((s, "I"), 0.0), float(peak - live1))
                retained[s] = max(retained.get(s, 0.0), float(live1 - live0))
    return {"best": best, "retained": retained, "work": work}


def _fit(runs: dict[int, dict[str, Any]], sizes: tuple[int, ...], num_stages: int) -> list[StageMeasure]:
    """Each (stage, kind)'s time through the two sizes as ``fixed + per_sample * b``
    (fixed at least 0); bytes per sample from the first size (the example's)."""
    (b1, r1), (b2, r2) = ((b, runs[b]) for b in sizes)
    out = []
    for s in range(num_stages):
        fixed, per = {}, {}
        for kind in ("F", "I", "W", "B"):
            if (s, kind) not in r1["best"]:
                continue
            t1, t2 = r1["best"][(s, kind)], r2["best"][(s, kind)]
            slope = max((t1 - t2) / (b1 - b2), 0.0)
            base = t1 - slope * b1
            if base < 0:  # a fixed part below zero is noise: proportional through the example size
                slope, base = t1 / b1, 0.0
            fixed[kind], per[kind] = base, slope
        out.append(StageMeasure(fixed, per, r1["retained"].get(s, 0.0) / b1, r1["work"].get((s, "B"), 0.0) / b1,
                                r1["work"].get((s, "I"), 0.0) / b1))
    return out
