"""Data parallelism around a stage: when gradients are reduced, and the one average per step.

Part of the stage layer. A stage's module may be wrapped in DDP or FSDP2 over a
data-parallel group; the pipeline's interleaving of forwards and backwards decides
when gradients are complete, so the wrappers' own hooks are steered from here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["set_grad_sync", "sync_data_parallel"]


def set_grad_sync(module: torch.nn.Module, enabled: bool) -> None:
    """Let an FSDP2 (``fully_shard``) module reduce gradients only on the step's last backward.

    DDP decides at *forward* time whether the next backward syncs, which cannot
    follow a pipeline's interleaving of forwards and backwards; a DDP module is
    never synced by its hooks and :func:`sync_data_parallel` averages once per step.
    """
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
    """
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
