"""Rank bodies: PP2 x DP2 x TP2 on 8 gloo ranks, traced stages from ``build_schedule`` on
``mesh["pp"]``, then ``ps.parallelize`` with per-block FSDP2 on ``mesh["dp"]`` and a
Megatron-style TP plan on ``mesh["tp"]``.

Ranks sit on the mesh ``(pp, dp, tp)``: rank = 4 * pp + 2 * dp + tp. A data-parallel
replica runs its half of the global batch (both TP ranks of it the same rows); the
reference is the unsplit model on the whole batch (mean loss).
"""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo
from tests.dist.nd_bodies import _stage_grads

LAYERS = 4
MAX_NORM = 0.05
STAGES = {"1F1B": 2, "ZBVZeroBubble": 4}
N_MB = 2  # microbatches per replica per step: 2 rows each


def entry(num_stages: int = 2) -> zoo.ZooEntry:
    return zoo.get("tiny_llama", n_layer=LAYERS, num_stages=num_stages, seq_len=8, batch_size=8)


def reference() -> dict:
    """The unsplit model on the whole batch: loss, every gradient, and the total 2-norm
    ``torch.nn.utils.clip_grad_norm_`` reports before clipping."""
    e = entry()
    loss = e.loss_fn(e.model(*e.args), e.target)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in e.model.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(e.model.parameters(), MAX_NORM))
    return {"loss": loss.item(), "grads": grads, "norm": norm}


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"layers.*.{lin}": ColwiseParallel() for lin in ("attention.wq", "attention.wk", "attention.wv",
                                                            "feed_forward.w1", "feed_forward.w3")}
    plan.update({f"layers.*.{lin}": RowwiseParallel() for lin in ("attention.wo", "feed_forward.w2")})
    return plan


def pp_dp_tp(rank: int, world: int, schedule: str) -> dict:
    """One step of ``schedule`` on PP2 x DP2 x TP2, then ``ps.clip_grad_norm_``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    e = entry(STAGES[schedule])
    tokens, positions = e.args
    mb = 4 // N_MB  # each replica runs 4 rows
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:mb], positions[:mb]))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=e.loss_fn, group=mesh["pp"])
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"], tp_mesh=mesh["tp"], tp_plan=tp_plan())
    placements = {n: tuple(str(x) for x in p.placements) for st in sched.stages
                  for n, p in st.module.named_parameters() if hasattr(p, "placements")}
    dp = mesh.get_local_rank("dp")
    half = slice(4 * dp, 4 * dp + 4)
    sched.step(tokens[half], positions[half], target=e.target[half])
    grads = _stage_grads(sched.stages)  # before clipping scales them
    norm = float(ps.clip_grad_norm_(sched, MAX_NORM))
    return {"loss": float(sched.loss), "grads": grads, "norm": norm, "placements": placements,
            "coords": (mesh.get_local_rank("pp"), dp, mesh.get_local_rank("tp"))}
