"""Gradient clipping over a whole pipeline: one norm across every stage of every rank.

Sits after the runtime (a step has left each rank's stages with their gradients, tied
parameters already summed across stages) and before the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .schedule.pipeline_schedule import PipelineSchedule

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(sched: PipelineSchedule, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of every rank's stages to one total norm, like
    ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.

    The norm runs over all stages of all ranks of the schedule's group (a
    parameter shared by several stages, such as tied embeddings, counts once),
    sharded gradients of ``fully_shard`` stages included over their data-parallel
    group. Call it on every rank after ``step()``; every rank gets the same total.

    Args:
        sched: a schedule after ``step()``.
        max_norm: the largest total norm allowed.
        norm_type: p of the p-norm; ``float("inf")`` for the largest absolute value.
        error_if_nonfinite: raise (on every rank) when the total norm is NaN or inf.

    Returns:
        The total norm before clipping (a scalar tensor, fp32), the same on every rank.

    Example (one process holding both stages of a V schedule; on ranks, the same calls):
        >>> import pippy_split as ps
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> pipe = ps.pipeline(model, ["2"], (torch.randn(2, 4),))
        >>> sched = ps.build_schedule(pipe, "ZBVZeroBubble", 4, loss_fn=torch.nn.functional.mse_loss)
        >>> _ = sched.step(torch.randn(8, 4), target=torch.randn(8, 2))
        >>> total = ps.clip_grad_norm_(sched, max_norm=1e-3)  # then optimizer.step()
        >>> after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        >>> bool(total > 1e-3), round(float(after), 6)  # the stages hold the model's own parameters
        (True, 0.001)
    """
    norm_type = float(norm_type)
    counted, scaled = _parameters(sched)
    device = sched.stages[0].device
    norms = [_norm(cast(torch.Tensor, p.grad), norm_type) for p in counted]  # _parameters: grad is set
    if norm_type == float("inf"):
        local = torch.stack(norms).max() if norms else torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    else:
        local = torch.stack([n ** norm_type for n in norms]).sum() if norms else torch.zeros((), device=device)
        op = dist.ReduceOp.SUM
    total = local.to(device=device, dtype=torch.float32)
    if sched.world > 1:
        dist.all_reduce(total, op=op, group=sched.group)
    if norm_type != float("inf"):
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the pipeline's gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in scaled:
        assert p.grad is not None  # _parameters keeps only parameters with a gradient
        p.grad.mul_(coef.to(p.grad.device))
    return total


def _norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    norm = torch.linalg.vector_norm(grad, norm_type)
    full = getattr(norm, "full_tensor", None)  # a sharded (DTensor) gradient: reduce over its mesh
    norm = full() if full is not None else norm
    return norm.to(torch.float32)


def _parameters(sched: PipelineSchedule) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(parameters whose gradients count towards the norm, parameters to scale) on this rank.

    A parameter shared by several stages counts only where its first holder lives;
    every local copy is scaled. One object held by two local stages is taken once.
    """
    pipe = sched.stages[0].pipe
    skip: set[int] = set()
    if pipe is not None:
        local = {s.stage_index: s for s in sched.stages}
        for holders in pipe.shared_parameters.values():
            first = holders[0][0]
            kept: set[int] = set()  # the first holder's copy: it counts, even where a later holder holds that object
            later: set[int] = set()
            for stage_index, names in holders:
                st = local.get(stage_index)
                if st is not None:
                    ids = {id(st.module.get_parameter(n)) for n in names}
                    (kept if stage_index == first else later).update(ids)
            skip |= later - kept
    counted, scaled, seen = [], [], set()
    for st in sched.stages:
        for p in st.module.parameters():
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            scaled.append(p)
            if id(p) not in skip:
                counted.append(p)
    return counted, scaled
