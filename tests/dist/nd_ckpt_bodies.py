"""Rank bodies: DCP checkpoints of FSDP2- and TP-sharded traced stages, keyed by the model's
own FQNs, read back into another layout (the unsplit model, or PP4 with plain stages).

The reference is the unsplit model on the whole global batch (mean loss) after the same
optimizer step.
"""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import checkpoint, zoo

LAYERS = 4
N_MB = 2
SGD = {"lr": 0.1, "momentum": 0.9}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}


def entry(num_stages: int = 2) -> zoo.ZooEntry:
    return zoo.get("tiny_llama", n_layer=LAYERS, num_stages=num_stages, seq_len=8, batch_size=8)


def _full(t):
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def reference(optim: str) -> dict:
    """The unsplit model after one step of ``optim`` ("sgd" or "adamw") on the whole batch:
    its weights and its optimizer state, by FQN."""
    e = entry()
    model = e.model
    opt = (torch.optim.SGD(model.parameters(), **SGD) if optim == "sgd"
           else torch.optim.AdamW(model.parameters(), **ADAMW))
    e.loss_fn(model(*e.args), e.target).backward()
    opt.step()
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}}


def _held(stages, opt) -> dict:
    """This rank's parameters and optimizer state, gathered whole, by FQN."""
    weights, state, sharded = {}, {}, []
    for st in stages:
        for n, p in st.module.named_parameters():
            weights[n] = _full(p)
            state[n] = {k: _full(v) for k, v in opt.state.get(p, {}).items()}
            if hasattr(p, "placements"):
                sharded.append(n)
    return {"weights": weights, "state": state, "sharded": sharded}


def pp2_tp2_save(rank: int, world: int, path: str) -> dict:
    """PP2 x TP2 on traced stages (TP by ``ps.parallelize``), one SGD step with momentum on the
    whole batch, then ``checkpoint.save`` of the schedule and the optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dist.nd8_bodies import tp_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    e = entry()
    tokens, positions = e.args
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:4], positions[:4]))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=e.loss_fn, group=mesh["pp"])
    ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan=tp_plan())
    opt = torch.optim.SGD([p for st in sched.stages for p in st.module.parameters()], **SGD)
    sched.step(tokens, positions, target=e.target)
    opt.step()
    checkpoint.save(path, sched, opt, extra={"step": 1})
    return _held(sched.stages, opt)


def pp2_fsdp_save(rank: int, world: int, path: str) -> dict:
    """PP2 x DP2 on traced stages, per-block FSDP2 (``layers.*``) by ``ps.parallelize``; one
    AdamW step, each replica on its half of the batch, then ``checkpoint.save``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    e = entry()
    tokens, positions = e.args
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:2], positions[:2]))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=e.loss_fn, group=mesh["pp"])
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"])
    opt = torch.optim.AdamW([p for st in sched.stages for p in st.module.parameters()], **ADAMW)
    half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
    sched.step(tokens[half], positions[half], target=e.target[half])
    opt.step()
    checkpoint.save(path, sched, opt, extra={"step": 1})
    return _held(sched.stages, opt)


def pp4_load(rank: int, world: int, path: str) -> dict:
    """PP4: 4 plain traced stages on 4 ranks, weights zeroed, then ``checkpoint.load`` of the
    schedule and a fresh AdamW over its parameters."""
    e = entry(4)
    tokens, positions = e.args
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:4], positions[:4]))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=e.loss_fn)
    assert len(sched.stages) == 1 and sched.stages[0].stage_index == rank
    with torch.no_grad():
        for p in e.model.parameters():
            p.zero_()
    opt = torch.optim.AdamW([p for st in sched.stages for p in st.module.parameters()], **ADAMW)
    extra = checkpoint.load(path, sched, opt)
    return {**_held(sched.stages, opt), "extra": extra,
            "hyper": {k: v for k, v in opt.param_groups[0].items() if k != "params"}}


def pp2_tp2_load(rank: int, world: int, path: str) -> dict:
    """PP2 x TP2 on 4 traced stages (Interleaved1F1B), TP by ``ps.parallelize``, weights zeroed,
    then ``checkpoint.load`` of the schedule and a fresh AdamW: each TP rank reads its shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.dist.nd8_bodies import tp_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    e = entry(4)
    tokens, positions = e.args
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:4], positions[:4]))
    sched = ps.build_schedule(pipe, "Interleaved1F1B", N_MB, loss_fn=e.loss_fn, group=mesh["pp"])
    ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan=tp_plan())
    with torch.no_grad():
        for st in sched.stages:
            for p in st.module.parameters():
                p.zero_()
    opt = torch.optim.AdamW([p for st in sched.stages for p in st.module.parameters()], **ADAMW)
    extra = checkpoint.load(path, sched, opt)
    return {**_held(sched.stages, opt), "extra": extra}
