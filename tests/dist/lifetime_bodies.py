"""Rank bodies checking that a step's autograd graphs are gone when the step returns."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn as nn

import pippy_split as ps


class TanhStack(nn.Module):
    """Four Linear+Tanh blocks; tanh saves its own output for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def graphs_alive_after_step(rank: int, world: int, schedule: str, release: bool) -> int:
    """How many tanh outputs of this rank's stages are still alive after two steps."""
    torch.manual_seed(0)
    model = TanhStack()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = ps.pipeline(model, ["blocks.1", "blocks.2", "blocks.3"], x[:2])
    sched = ps.build_schedule(pipe, schedule, 4, loss_fn=nn.functional.mse_loss)
    sched.release_sent_outputs = release
    refs: list[weakref.ref] = []
    # each stage's output is a tanh output, which autograd saves: while it lives, so does its graph
    for st in sched.stages:
        st.module.register_forward_hook(lambda mod, args, out: refs.extend(
            weakref.ref(o) for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)))
    for _ in range(2):
        sched.step(x, target=y)
    gc.collect()
    return sum(r() is not None for r in refs)
