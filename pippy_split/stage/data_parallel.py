"""Data parallelism around a stage: when gradients are reduced, and the one average per step.

Part of the stage layer. A stage's module may be wrapped in DDP or FSDP2 over a
data-parallel group; the pipeline's interleaving of forwards and backwards decides
when gradients are complete, so the wrappers' own hooks are steered from here. The
runtime calls :func:`set_grad_sync` with ``False`` on every stage at the start of a step and
with ``True`` before each stage's last backward, and the schedule calls
:func:`sync_data_parallel` on every stage at the end of a training step (before the caller's
optimizer): FSDP2 blocks kept gathered for a step (``ps.parallelize(fsdp_gather="once")``,
:mod:`.gather_once`) are kept from the first and put back to their shards at the second.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from . import gather_once

__all__ = ["set_grad_sync", "sync_data_parallel", "holds_sharded_state", "unsplittable_backward"]


def set_grad_sync(module: torch.nn.Module, enabled: bool) -> None:
    """Let an FSDP2 (``fully_shard``) module reduce gradients only on the step's last backward.

    DDP decides at *forward* time whether the next backward syncs, which cannot
    follow a pipeline's interleaving of forwards and backwards; a DDP module is
    never synced by its hooks and :func:`sync_data_parallel` averages once per step.

    ``enabled=False`` is the start of a step: in a training step (gradients enabled) the
    FSDP2 modules :mod:`.gather_once` chose stay gathered from their first forward to the
    step's end.
    """
    if not enabled:
        gather_once.begin_step(module)
    target: Any = module  # DDP or an FSDP2 module, duck-typed
    if hasattr(target, "require_backward_grad_sync"):
        target.require_backward_grad_sync = False  # DDP: see sync_data_parallel
    if hasattr(target, "set_requires_gradient_sync"):
        target.set_requires_gradient_sync(enabled)


def sync_data_parallel(module: torch.nn.Module) -> None:
    """Average gradients of a DDP-wrapped stage over its data-parallel group.

    One all-reduce per parameter dtype, over every trainable parameter in module
    order (the same on every replica), so replicas that differ in which parameters
    got a gradient (a branch one replica took) still reduce buffers of one size: a
    missing gradient counts as zeros, and a parameter no replica touched keeps
    ``grad=None``.

    First, FSDP2 modules kept gathered for the step (:mod:`.gather_once`) go back to their
    shards: their gradients are reduce-scattered by now, and the optimizer must update the
    shards that the next step gathers.
    """
    gather_once.end_step(module)
    group = getattr(module, "process_group", None)
    if not hasattr(module, "require_backward_grad_sync") or group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in module.parameters():
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    replicas = dist.get_world_size(group)
    for dtype, params in by_dtype.items():
        present = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=params[0].device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [present])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p, count in zip(params, flat[-len(params):].tolist()):
            mean = flat[offset: offset + p.numel()].view_as(p) / replicas
            offset += p.numel()
            if count == 0:
                continue
            if p.grad is None:
                p.grad = mean.clone()
            else:
                p.grad.copy_(mean)


def holds_sharded_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` (or any submodule) is an FSDP2 module or holds a DTensor parameter
    or buffer (tensor parallelism): a fake forward cannot run it (FSDP's hooks all-gather
    real shards, DTensor ops refuse mixed tensors) and would leave FSDP's state out of step."""
    if _has_fsdp(module):
        return True
    return any(isinstance(t, DTensor) for t in [*module.parameters(), *module.buffers()])


def _has_fsdp(module: torch.nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules())


def unsplittable_backward(module: torch.nn.Module, planned: list[torch.nn.Parameter] | None) -> str | None:
    """Why a separate weight-gradient pass (W of the zero-bubble I/W split) would leave this
    stage's gradients missing or wrong, or None where W can be split from I.

    ``planned``: the parameters a traced stage's split was planned for (None: hand-built,
    where W differentiates ``module.parameters()`` as they are at W).

    Example:
        >>> unsplittable_backward(torch.nn.Linear(2, 2), None) is None
        True
    """
    if _has_fsdp(module):
        return ("its module is wrapped in FSDP2 (fully_shard): FSDP reduce-scatters a block's gradients (and "
                "reshards its parameters) when the backward reaches the block's inputs, which is in I, before a "
                "separate W could add the weight gradients")
    if planned is not None:
        current = {id(p) for p in module.parameters()}
        gone = sum(id(p) not in current for p in planned)
        if gone:
            return (f"{gone} of the {len(planned)} parameters its I/W split was planned for are no longer the "
                    "module's (replaced after the schedule was built: a wrapper, or a load with assign=True), so W "
                    "would write the old ones")
    return None
