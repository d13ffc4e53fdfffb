"""Rank bodies for the activation-checkpointing dist tests: selective regions, dropout and BatchNorm."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import pippy_split as ps


def selective_step(rank: int, world: int, name: str, schedule: str, n_mb: int, patterns: list[str]):
    """One step of a zoo model with selective checkpointing; loss, grads by FQN, region counts."""
    from .training_bodies import zoo_step

    sched, out = zoo_step(name, schedule, n_mb, activation_checkpoint=patterns)
    return {**out, "counts": [st.region_counts for st in sched.stages]}


class DropBlock(nn.Module):
    """Linear -> BatchNorm (train mode: running statistics move) -> Dropout, residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.drop(self.bn(self.fc(x))))


class DropNet(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[DropBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def dropout_bn_step(rank: int, world: int, schedule: str, checkpoint):
    """Two steps of DropNet; returns the loss, every state tensor and every grad of this rank's stages.
    The RNG is seeded identically for any ``checkpoint``, so runs with and without it must agree bitwise."""
    torch.manual_seed(0)
    model = DropNet()
    x, y = torch.randn(16, 16), torch.randint(0, 3, (16,))
    looped = schedule in ("ZBVZeroBubble", "Interleaved1F1B", "InterleavedZeroBubble", "DualPipeV")
    split = ["blocks.1", "blocks.2", "blocks.3"] if looped else ["blocks.2"]
    pipe = ps.pipeline(model, split, x[:4])
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=F.cross_entropy, activation_checkpoint=checkpoint)
    torch.manual_seed(123 + rank)
    losses = []
    for _ in range(2):
        sched.step(x, target=y)
        losses.append(float(sched.loss))
    state = {}
    for st in sched.stages:
        state.update({k: v.clone() for k, v in st.module.state_dict().items()})
        state.update({"grad:" + k: p.grad.clone() for k, p in st.module.named_parameters()})
    return {"losses": losses, "state": state}


def bf16_step(rank: int, world: int, schedule: str, checkpoint):
    """One bf16 (autocast) step of tiny_gpt; loss and this rank's grads."""
    from .training_bodies import zoo_step

    return zoo_step("tiny_gpt", schedule, 4, activation_checkpoint=checkpoint, mixed_precision=torch.bfloat16)[1]
