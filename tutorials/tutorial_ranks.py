"""Rank bodies for tutorial 04, in a module of their own.

A rank process started by ``run_ranks`` (or multiprocessing generally) finds its
function by importing the module that defines it. A function defined in a notebook
cell lives in ``__main__``, which a fresh process cannot import, so the notebook
imports ``train`` from here (this file sits beside the tutorials, on the notebook's
path) and the ranks import it the same way.
"""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo

__all__ = ["train"]


def train(rank: int, world_size: int, steps: int = 4, schedule: str = "ZBVZeroBubble") -> list[float]:
    """Train the zoo's tiny GPT for ``steps`` steps on this rank's stages; return the losses."""
    entry = zoo.get("tiny_gpt")  # 4 blocks -> 4 stages; with 2 ranks, 2 stages per rank
    (x,), y = entry.args, entry.target  # (8, 32) token ids and next-token targets
    n_mb = 4
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[: x.shape[0] // n_mb],))
    sched = ps.build_schedule(pipe, schedule, n_microbatches=n_mb, loss_fn=entry.loss_fn)
    params = [p for stage in sched.stages for p in stage.module.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    if rank == 0:
        print(f"{schedule}: rank {rank} holds stages {[s.stage_index for s in sched.stages]}", flush=True)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        sched.step(x, target=y)  # identical call on every rank
        opt.step()
        losses.append(float(sched.loss))  # the step's mean loss, known on every rank
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    return losses
