"""Rank bodies for data-parallel x pipeline tests where replicas differ in which parameters get a gradient."""

from __future__ import annotations

import torch
import torch.nn as nn

import pippy_split as ps


class Branchy(nn.Module):
    """Stage 0: takes branch ``a`` on inputs of positive mean, else ``b`` (decided per
    replica in Python, as a config flag or a data-dependent router would)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.use_a: bool | None = None  # None: decide from the data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_a = self.use_a if self.use_a is not None else bool(x.mean() > 0)
        return torch.tanh(self.a(x) if use_a else self.b(x))


def branchy_parts(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return Branchy(), nn.Linear(6, 2)


def replica_batch(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica 0's inputs are all positive (branch a), replica 1's all negative (branch b)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g).abs(), torch.randn(8, 2, generator=g)
    return (x if replica == 0 else -x), y


def branchy_reference(n_mb: int) -> dict[str, torch.Tensor]:
    """Per parameter: the mean over both replicas of its gradient (zero where a replica took the other branch)."""
    first, last = branchy_parts()
    params = {**{f"0.{n}": p for n, p in first.named_parameters()}, **{f"1.{n}": p for n, p in last.named_parameters()}}
    for replica in (0, 1):
        x, y = replica_batch(replica)
        for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
            (nn.functional.mse_loss(last(first(xm)), ym) / n_mb).backward()
    return {n: p.grad / 2 for n, p in params.items()}


def branchy_pp_dp(rank: int, world: int, n_mb: int) -> dict[str, torch.Tensor | None]:
    """PP=2 x DP=2 on 4 ranks, hand-built stages wrapped in DDP; this rank's averaged grads."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp, dp = pp_groups[rank // 2], dp_groups[rank % 2]
    index = rank % 2
    module = branchy_parts()[index]
    if index == 0:
        module.use_a = rank // 2 == 0
    stage = ps.PipelineStage(DDP(module, process_group=dp), index, 2, group=pp)
    sched = ps.Schedule1F1B(stage, n_mb, loss_fn=nn.functional.mse_loss)
    x, y = replica_batch(rank // 2)
    sched.step(x, target=y)
    return {f"{index}.{n}": (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}
