"""Rank bodies for N-D parallelism tests: pipelining on one dimension of a DeviceMesh,
combined with FSDP2, DDP or tensor parallelism on the others.

The reference is always the unsplit model on the whole global batch (mean loss);
a data-parallel replica runs its half of the batch.
"""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo

N_MB = 2
LR = 0.1
MAX_NORM = 0.05


def llama_entry() -> zoo.ZooEntry:
    """A two-layer tiny Llama (2 stages), global batch 8 of 8 tokens."""
    return zoo.get("tiny_llama", n_layer=2, num_stages=2, seq_len=8, batch_size=8)


def llama_reference(steps_after: bool = False) -> dict:
    """The unsplit model on the whole batch: loss, gradients, clipped total norm, and
    (``steps_after``) the weights after clipping to ``MAX_NORM`` and one SGD step."""
    entry = llama_entry()
    model = entry.model
    loss = entry.loss_fn(model(*entry.args), entry.target)
    loss.backward()
    out: dict = {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    if steps_after:
        out["norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        torch.optim.SGD(model.parameters(), lr=LR).step()
        out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _pp_dp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))


def _stage_grads(stages) -> dict:
    out = {}
    for st in stages:
        for n, p in st.module.named_parameters():
            if p.grad is not None:
                g = p.grad
                out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def mesh_build_schedule(rank: int, world: int, schedule: str, ckpt_root: str) -> dict:
    """PP on ``mesh["pp"]`` of a (dp=2, pp=2) mesh; each replica runs the whole batch alone.
    ``build_schedule``, ``clip_grad_norm_`` and ``checkpoint.save`` each get the mesh dimension."""
    from pippy_split import checkpoint

    mesh = _pp_dp_mesh()
    entry = llama_entry()
    tokens, positions = entry.args
    pipe = ps.pipeline(entry.model, entry.split_spec, (tokens[:4], positions[:4]))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=entry.loss_fn, group=mesh["pp"])
    sched.step(tokens, positions, target=entry.target)
    grads = _stage_grads(sched.stages)
    norm = float(ps.clip_grad_norm_(sched, MAX_NORM))
    opt = torch.optim.SGD([p for st in sched.stages for p in st.module.parameters()], lr=LR)
    opt.step()
    replica = mesh.get_local_rank("dp")
    checkpoint.save(f"{ckpt_root}/replica{replica}", sched, group=mesh["pp"])
    return {"loss": float(sched.loss), "grads": grads, "norm": norm}


def mesh_plan(rank: int, world: int) -> dict:
    """``ps.plan(..., group=mesh["pp"])`` and ``plan.best.build_schedule(group=mesh["pp"])``."""
    mesh = _pp_dp_mesh()
    entry = llama_entry()
    tokens, positions = entry.args
    plan = ps.plan(entry.model, (tokens[:4], positions[:4]), num_ranks=2, memory_budget="1GB",
                   loss_fn=entry.loss_fn, global_batch=8, schedules=["1F1B"], microbatches=[2],
                   measure=False, profile_passes=1, group=mesh["pp"])
    sched = plan.best.build_schedule(group=mesh["pp"])
    sched.step(tokens, positions, target=entry.target)
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages)}


def two_dim_mesh_refused(rank: int, world: int) -> str:
    """The whole 2-D mesh as the pipeline's group: a ValueError naming the dimension to pass."""
    mesh = _pp_dp_mesh()
    entry = llama_entry()
    tokens, positions = entry.args
    pipe = ps.pipeline(entry.model, entry.split_spec, (tokens[:4], positions[:4]))
    try:
        ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=entry.loss_fn, group=mesh)
    except ValueError as e:
        return str(e)
    return "no error"
