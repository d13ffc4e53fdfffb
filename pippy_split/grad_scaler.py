"""Loss scaling for fp16 pipelines: one found-inf decision for every rank.

Sits after the runtime and around the optimizer, like ``torch.amp.GradScaler``, but
for a pipeline: the loss is multiplied inside the schedule's backward (on the rank
holding the last stage), and whether any gradient overflowed is agreed over the
pipeline group (and each data-parallel group), so every rank skips the same steps and
keeps the same scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist

from .stage.groups import process_group

if TYPE_CHECKING:
    from .schedule.pipeline_schedule import PipelineSchedule

__all__ = ["PipelineGradScaler"]


class PipelineGradScaler:
    """Dynamic loss scaling for a schedule run with ``mixed_precision=torch.float16``.

    Args:
        sched: the schedule (every rank builds its scaler with its own schedule).
        init_scale: the first scale.
        growth_factor / backoff_factor: how the scale grows after ``growth_interval``
            clean steps in a row, and shrinks after a step with an overflow.
        growth_interval: clean steps before the scale grows.
        extra_groups: more process groups to agree over (data-parallel groups of
            wrapped stages); the pipeline group is always included.

    Example (one process holding both stages of a V schedule; on ranks, the same calls):
        >>> import pippy_split as ps
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> pipe = ps.pipeline(model, ["2"], (torch.randn(2, 4),))
        >>> sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=torch.nn.functional.mse_loss,
        ...                           mixed_precision=torch.float16)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = ps.PipelineGradScaler(sched, init_scale=1024.0)
        >>> _ = sched.step(torch.randn(8, 4), target=torch.randn(8, 2))  # backward of loss * scale
        >>> scaler.step(optimizer)  # unscale, agree on inf, step or skip everywhere
        True
        >>> optimizer.zero_grad()
    """

    def __init__(self, sched: PipelineSchedule, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 extra_groups: Iterable[Any] = ()) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1 and init_scale > 0):
            raise ValueError("need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.sched = sched
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.extra_groups = [process_group(g, "GradScaler extra_groups") for g in extra_groups]
        self.clean_steps = 0
        self.skipped_steps = 0
        sched.loss_scale = self.scale

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale this rank's gradients, agree with every rank on whether any overflowed,
        then step ``optimizer`` or skip it everywhere. Returns whether it stepped."""
        grads = [p.grad for st in self.sched.stages for p in st.module.parameters() if p.grad is not None]
        inv = 1.0 / self.scale
        found = torch.zeros((), device=self.sched.stages[0].device)
        for grad in grads:
            grad.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(grad)).any().to(found.dtype))
        if self.sched.world > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.sched.group)
        for group in self.extra_groups:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        overflow = bool(found.item())
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.scale *= self.backoff_factor
        else:
            optimizer.step()
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
        self.sched.loss_scale = self.scale
        return not overflow
