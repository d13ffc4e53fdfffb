"""Rank bodies for N-D parallelism tests: pipelining on one dimension of a DeviceMesh,
combined with FSDP2, DDP or tensor parallelism on the others.

The reference is always the unsplit model on the whole global batch (mean loss);
a data-parallel replica runs its half of the batch.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

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
    pg = sched.pipeline_group  # group-local: this rank's place in its own pipeline, not in the world
    return {"loss": float(sched.loss), "grads": grads, "norm": norm,
            "pg": (pg.rank, pg.world, mesh["pp"].get_local_rank(), pg.group is mesh["pp"].get_group())}


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


# --------------------------------------------------------------------------- #
# Hand-built stages (the torchtitan route): a deep copy keeps a slice of layers
# --------------------------------------------------------------------------- #

HB_LAYERS = 4  # hand-built tests: 4 layers, 2 or 4 stages


def hb_entry() -> zoo.ZooEntry:
    return zoo.get("tiny_llama", n_layer=HB_LAYERS, num_stages=2, seq_len=8, batch_size=8)


class LlamaStage(nn.Module):
    """Layers ``lo..hi-1`` of a deep copy of a TinyLlama (plus the embedding on the first
    stage, the norm and head on the last), under the model's own FQNs; the positions travel
    along with the hidden state."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        m = copy.deepcopy(model)
        self.tok_embeddings = m.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): m.layers[i] for i in range(lo, hi)})
        self.norm = m.norm if last else None
        self.output = m.output if last else None
        self.register_buffer("freqs_cis", m.freqs_cis, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        freqs = self.freqs_cis[positions]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, freqs, positions)
        if self.output is None:
            return h, positions
        return self.output(self.norm(h))


def hb_reference() -> dict:
    entry = hb_entry()
    loss = entry.loss_fn(entry.model(*entry.args), entry.target)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in entry.model.named_parameters()}}


def _stage_modules(model: nn.Module, schedule: str, pp_rank: int, pp_size: int) -> dict[int, LlamaStage]:
    """This rank's stage modules, placed as ``schedule`` places them."""
    num_stages = _STAGES[schedule]
    where = ps.get_schedule_class(schedule).stage_placement(num_stages, pp_size, None)
    per = HB_LAYERS // num_stages
    return {s: LlamaStage(model, s * per, (s + 1) * per, s == 0, s == num_stages - 1)
            for s in range(num_stages) if where[s] == pp_rank}


_STAGES = {"GPipe": 2, "1F1B": 2, "Interleaved1F1B": 4, "ZBVZeroBubble": 4, "InterleavedZeroBubble": 4,
           "DualPipeV": 4}


def _run_hand_built(mods: dict[int, nn.Module], schedule: str, pp_group, batch: tuple, target) -> dict:
    num_stages = _STAGES[schedule]
    stages = [ps.PipelineStage(mods[s], s, num_stages, group=pp_group) for s in sorted(mods)]
    n_mb = 4 if schedule == "DualPipeV" else N_MB  # DualPipeV needs 2 * ranks - 1 microbatches
    sched = ps.get_schedule_class(schedule)(stages, n_mb, loss_fn=hb_entry().loss_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step(*batch, target=target)
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages),
            "fused": [st.weight_grads_in_input for st in sched.stages], "warned": [str(w.message) for w in caught]}


def hand_built_fsdp(rank: int, world: int, schedule: str) -> dict:
    """PP2 x DP2: per-block ``fully_shard`` then the stage root, over ``mesh["dp"]``; each
    replica runs its half of the batch."""
    from torch.distributed.fsdp import fully_shard

    mesh = _pp_dp_mesh()
    entry = hb_entry()
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    mods = _stage_modules(entry.model, schedule, pp_rank, 2)
    for mod in mods.values():
        for block in mod.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(mod, mesh=mesh["dp"])
    half = slice(4 * dp_rank, 4 * dp_rank + 4)
    tokens, positions = entry.args
    return _run_hand_built(mods, schedule, mesh["pp"], (tokens[half], positions[half]), entry.target[half])


def tp_plan(mod: nn.Module) -> dict:
    """Megatron-style plan for this stage's blocks: q/k/v and w1/w3 column-wise, wo and w2 row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    for name in mod.layers:
        for lin in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{name}.{lin}"] = ColwiseParallel()
        for lin in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{name}.{lin}"] = RowwiseParallel()
    return plan


def hand_built_tp(rank: int, world: int, schedule: str) -> dict:
    """PP2 x TP2: ``parallelize_module`` on each stage over ``mesh["tp"]``; both TP ranks run the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    entry = hb_entry()
    mods = _stage_modules(entry.model, schedule, mesh.get_local_rank("pp"), 2)
    for mod in mods.values():
        parallelize_module(mod, mesh["tp"], tp_plan(mod))
    return _run_hand_built(mods, schedule, mesh["pp"], entry.args, entry.target)


def hand_built_ddp(rank: int, world: int, schedule: str) -> dict:
    """PP2 x DP2: each stage module wrapped in DDP over ``mesh["dp"]``; each replica runs its half."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = _pp_dp_mesh()
    entry = hb_entry()
    dp_rank = mesh.get_local_rank("dp")
    mods = _stage_modules(entry.model, schedule, mesh.get_local_rank("pp"), 2)
    wrapped = {s: DDP(m, process_group=mesh["dp"].get_group()) for s, m in mods.items()}
    half = slice(4 * dp_rank, 4 * dp_rank + 4)
    tokens, positions = entry.args
    out = _run_hand_built(wrapped, schedule, mesh["pp"], (tokens[half], positions[half]), entry.target[half])
    out["grads"] = {n.removeprefix("module."): g for n, g in out["grads"].items()}
    return out


def traced_fsdp_after_build(rank: int, world: int, schedule: str) -> dict:
    """Traced stages from ``build_schedule``, then ``fully_shard`` on each stage module over
    ``mesh["dp"]`` (after the schedule was built); each replica runs its half of the batch."""
    from torch.distributed.fsdp import fully_shard

    mesh = _pp_dp_mesh()
    entry = zoo.get("tiny_llama", n_layer=HB_LAYERS, num_stages=4, seq_len=8, batch_size=8)
    tokens, positions = entry.args
    pipe = ps.pipeline(entry.model, entry.split_spec, (tokens[:2], positions[:2]))
    n_mb = 4 if schedule == "DualPipeV" else N_MB
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, group=mesh["pp"])
    for st in sched.stages:
        fully_shard(st.module, mesh=mesh["dp"])
    half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step(tokens[half], positions[half], target=entry.target[half])
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages),
            "fused": [st.weight_grads_in_input for st in sched.stages], "warned": [str(w.message) for w in caught]}


def parallelize_helper(rank: int, world: int, schedule: str, kind: str) -> dict:
    """``ps.parallelize`` on hand-built stages, after the schedule was built: ``kind`` "fsdp"
    (PP2 x DP2, per-block FSDP2 by ``layers.*``) or "tp" (PP2 x TP2, a pattern plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    names = ("dp", "pp") if kind == "fsdp" else ("pp", "tp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    entry = hb_entry()
    mods = _stage_modules(entry.model, schedule, mesh.get_local_rank("pp"), 2)
    stages = [ps.PipelineStage(mods[s], s, _STAGES[schedule], group=mesh["pp"]) for s in sorted(mods)]
    sched = ps.get_schedule_class(schedule)(stages, N_MB, loss_fn=entry.loss_fn)
    tokens, positions = entry.args
    if kind == "fsdp":
        ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"])
        blocks = sum(type(m).__name__.startswith("FSDP") for st in stages for m in st.module.modules())
        half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
        batch, target = (tokens[half], positions[half]), entry.target[half]
    else:
        col, row = ColwiseParallel(), RowwiseParallel()
        ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan={
            "layers.*.attention.w[qkv]": col, "layers.*.attention.wo": row,
            "layers.*.feed_forward.w[13]": col, "layers.*.feed_forward.w2": row})
        blocks = sum(hasattr(p, "placements") for st in stages for p in st.module.parameters())
        batch, target = entry.args, entry.target
    sched.step(*batch, target=target)
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages), "wrapped": blocks}
