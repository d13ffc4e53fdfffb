"""Rank bodies of the planner tests (top-level so they pickle)."""

from __future__ import annotations

import pippy_split as ps
from pippy_split import zoo

GLOBAL_BATCH = 8


def plan_best_step(rank: int, world: int) -> dict:
    """Plan on every rank (time-balanced: rank 0's profile is shared, so the cuts agree),
    build the best candidate, run one step; return its loss and this rank's grads by FQN."""
    entry = zoo.get("mlp_stack", d=16)
    mb = entry.args[0][:2]
    plan = ps.plan(entry.model, (mb,), num_ranks=world, memory_budget="1GB", loss_fn=entry.loss_fn,
                   global_batch=GLOBAL_BATCH, microbatches=(2, 4),
                   schedules=["1F1B", "ZBVZeroBubble", "Interleaved1F1B"])
    best = plan.best
    sched = best.build_schedule()
    sched.step(*entry.args, target=entry.target)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "m": best.n_microbatches, "schedule": best.schedule,
            "comm": plan.comm.source, "cuts": best.split.positions, "step_time": best.step_time}
