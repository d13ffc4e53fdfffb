"""Rank bodies of the planner tests (top-level so they pickle)."""

from __future__ import annotations

import time

import torch

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


def checkpointed_zbv_memory(rank: int, world: int) -> dict:
    """Plan ZBV with full checkpointing (stages measured), run the plan's split, and count
    what autograd holds during one step; return predicted (measured and op-sum stage
    costs) and counted activation peaks of this rank."""
    import dataclasses

    from pippy_split.plan import predict_candidate
    from pippy_split.plan.saved_bytes import SavedBytes

    entry = zoo.get("tiny_gpt", d_model=32, n_layer=4, batch_size=8, seq_len=32, block_size=32)
    plan = ps.plan(entry.model, (entry.args[0][:2],), num_ranks=world, memory_budget="1GB", loss_fn=entry.loss_fn,
                   example_target=entry.target[:2], global_batch=8, microbatches=(4,), schedules=["ZBVZeroBubble"],
                   activation_checkpoint=(True,), balance=("flops",))
    best = plan.best
    scale = best.microbatch_size / best.split.batch
    predicted = {}
    for name, costs in (("measured", best.split), ("op sums", dataclasses.replace(best.split, measured=None))):
        cand = predict_candidate(costs, best.schedule, world, best.n_microbatches, True, scale, plan.comm, 2.0, plan.budget,
                        saved_only=True)
        predicted[name] = cand.simulation.peak_bytes[rank]
    sched = best.build_schedule()
    sched.step(*entry.args, target=entry.target)
    params = {p.untyped_storage().data_ptr() for st in sched.stages for p in st.module.parameters()}
    counter = SavedBytes(params)
    with counter.hooks():
        sched.step(*entry.args, target=entry.target)
    return {"predicted": predicted, "counted": counter.peak}



def timed_forward_behind_a_slow_stage(rank: int, world: int) -> dict:
    """Stage 0 (rank 0) sleeps 0.5 s before each forward; what rank 1's timed forwards record."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    pipe = ps.pipeline(model, ["1"], (x[:2],))
    sched = ps.build_schedule(pipe, "GPipe", 2, loss_fn=torch.nn.functional.mse_loss)
    for st in sched.stages:
        if st.stage_index == 0:
            st.module.register_forward_pre_hook(lambda *_: time.sleep(0.5))
    sched.step(x, target=y)
    with sched.timed_actions() as times:
        sched.step(x, target=y)
    return {str(t.action): t.seconds for t in times}
