"""Rank bodies of the torch 2.15 additions that need ranks (top-level so they pickle)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from pippy_split.compat import schedules as S
from pippy_split.compat import stage as compat_stage

from .bodies import MLP

N_MB = 2


def finalize_gradients_fsdp(rank: int, world: int) -> dict:
    """DP2 x PP1: a stage module under FSDP2 over both ranks, each rank its own data.
    Run 1: step(a, finalize_gradients=False), then step(b). Run 2: step(a), zero_grad, step(b).
    Returns whether run 1 reduced nothing after its first step, and its gradients against the
    sum of run 2's (every parameter as a full tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(0)
    base = MLP(2)
    g = torch.Generator().manual_seed(10 + rank)
    xa, ya, xb, yb = (torch.randn(4, 8, generator=g) for _ in range(4))

    def schedule():
        model = copy.deepcopy(base)
        fully_shard(model, mesh=mesh["dp"])
        st = compat_stage.PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
        return model, S.ScheduleGPipe(st, N_MB, loss_fn=F.mse_loss)

    def full_grads(model) -> dict:
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    model, sched = schedule()
    sched.step(xa, target=ya, finalize_gradients=False)
    deferred = all(p.grad is None for p in model.parameters())
    sched.step(xb, target=yb)
    accumulated = full_grads(model)

    model, sched = schedule()
    sched.step(xa, target=ya)
    grads_a = full_grads(model)
    model.zero_grad()
    sched.step(xb, target=yb)
    grads_b = full_grads(model)
    diff = max(float((accumulated[n] - grads_a[n] - grads_b[n]).abs().max()) for n in accumulated)
    return {"deferred": deferred, "max_diff": diff}
