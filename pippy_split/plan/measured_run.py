"""One measured schedule: a split's stages run through the real runtime on this process,
each action timed and the bytes autograd saves around it counted.

Part of :mod:`.measure` (which makes one :class:`MeasuredRun` per microbatch size and
setting, steps them in turn until their timings settle and fits each stage's action
times from them). A run builds every stage of the pipe here (one rank), runs
:class:`~pippy_split.schedule.ScheduleFromOrder` with an order of its own, microbatch
after microbatch through every stage (:func:`_order`), and records per (stage, kind) the
seconds of each action (``timed_actions``) in two halves, and per stage what
:class:`~.saved_bytes.SavedBytes` counts: the bytes an I leaves for its W and the most a
backward adds while it runs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from ..schedule.actions import Action, ActionKind
from ..schedule.schedules import ScheduleFromOrder
from ..split.pipe import Pipe
from ..stage.groups import GroupArg
from .costs import resize_batch
from .saved_bytes import SavedBytes

__all__ = ["MeasuredRun"]


class MeasuredRun:
    """One measured schedule: the split's stages at one microbatch size, plain or split
    backward, checkpointed or not. Per (stage, kind) the recorded times; per stage the
    saved bytes its I leaves for W and the most a backward adds."""

    def __init__(self, pipe: Pipe, example: tuple[tuple, dict], batch: int, b0: int, ac: bool, split: bool,
                 device: torch.device, group: GroupArg, loss_fn: Callable | None, example_target: Any,
                 flush_bytes: int) -> None:
        S = pipe.num_stages
        self.stages = [pipe.build_stage(s, device, group, activation_checkpoint="full" if ac else None)
                       for s in range(S)]
        n_mb = 3 if split else 2
        if loss_fn is not None and example_target is not None:
            self.target, loss = resize_batch((example_target,), b0, batch * n_mb)[0], loss_fn
        else:
            self.target, loss = torch.zeros(batch * n_mb, device=device), _surrogate_loss
        self.args = resize_batch(example[0], b0, batch * n_mb)
        self.kwargs = dict(zip(example[1], resize_batch(tuple(example[1].values()), b0, batch * n_mb)))
        self.sched = ScheduleFromOrder(self.stages, n_mb, loss, order=_order(S, split))
        self.params = {p.untyped_storage().data_ptr() for st in self.stages for p in st.module.parameters()}
        self.samples: dict[tuple[int, str], tuple[list[float], list[float]]] = {}
        """Per (stage, kind) the recorded seconds, in two halves: even and odd recorded steps."""
        self.recorded = 0
        self.retained: dict[int, float] = {}
        self.work: dict[tuple[int, str], float] = {}
        self.flush = torch.zeros(max(flush_bytes // 4, 1), device=device)

    def step(self, record: bool) -> None:
        counter = SavedBytes(self.params)

        def probe(c: SavedBytes = counter) -> tuple[int, int]:
            self.flush.add_(1.0)  # runs before the clock starts (and after it stops)
            return c.live, c.take_peak()

        with counter.hooks(), self.sched.timed_actions(probe=probe) as times:
            self.sched.step(*self.args, target=self.target, **self.kwargs)
        if not record:
            return
        half = self.recorded % 2
        self.recorded += 1
        for t in times:
            s, kind = t.action.stage, t.action.kind
            self.samples.setdefault((s, kind.value), ([], []))[half].append(t.seconds)
            (live0, _), (live1, peak) = t.before, t.after
            if kind is ActionKind.B:
                self.work[(s, "B")] = max(self.work.get((s, "B"), 0.0), float(peak - live0))
            if kind is ActionKind.I:
                self.work[(s, "I")] = max(self.work.get((s, "I"), 0.0), float(peak - live1))
                self.retained[s] = max(self.retained.get(s, 0.0), float(live1 - live0))

    def best(self, half: int | None = None) -> dict[tuple[int, str], float]:
        """Per (stage, kind) the least time: of every sample, or of one half's."""
        return {key: min(halves[half] if half is not None else halves[0] + halves[1])
                for key, halves in self.samples.items()}

    def close(self) -> None:
        for st in self.stages:
            for p in st.module.parameters():
                p.grad = None  # the model's own gradients are put back by measure._model_untouched


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
