"""Rank bodies: PP2 x per-block FSDP2 (dp=2, pp=2) with ``fsdp_gather="once"`` or per microbatch.

Two training steps with SGD between them on traced stages of the zoo's tiny Llama (4 blocks);
the reference is the unsplit model on the whole batch, stepped with the same SGD. The second
step's gradients are exact only if every block was back to its shard when the optimizer ran
(a block left gathered would run the second step on its old parameters). The second step is
the steady one whose FSDP2 all-gathers and reduce-scatters are counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import pippy_split as ps
from tests.dist.nd_bodies import _stage_grads
from tests.dist.traced_nd_bodies import STAGES, entry

LR = 0.1
N_MB = 4  # each replica runs 4 rows: one per microbatch


def reference() -> dict:
    """The unsplit model's gradients at both steps (mean loss over the whole batch)."""
    e = entry()
    grads = []
    for _ in range(2):
        loss = e.loss_fn(e.model(*e.args), e.target)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in e.model.named_parameters()})
        with torch.no_grad():
            for p in e.model.parameters():
                p -= LR * p.grad
                p.grad = None
    return {"grads": grads}


class _Count:
    """FSDP2's collectives on this rank (its defaults call these two), counted while on."""

    def __init__(self) -> None:
        self.gathers: list[int] = []
        self.scatters = 0
        self._inner = (dist.all_gather_single, dist.reduce_scatter_single)

    def __enter__(self) -> "_Count":
        gather, scatter = self._inner

        def spy_gather(output, input, *a, **kw):
            self.gathers.append(output.numel())
            return gather(output, input, *a, **kw)

        def spy_scatter(*a, **kw):
            self.scatters += 1
            return scatter(*a, **kw)

        dist.all_gather_single, dist.reduce_scatter_single = spy_gather, spy_scatter
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_single, dist.reduce_scatter_single = self._inner


def _all_sharded(stages, prefix: str = "") -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for st in stages for n, p in st.module.named_parameters() if n.startswith(prefix))


def two_steps(rank: int, world: int, schedule: str, how: str, budget, options: dict | None = None) -> dict:
    """Two steps (SGD between) with ``ps.parallelize(fsdp=["layers.*"], fsdp_gather=how,
    gather_budget=budget)``; the second counted. ``options``: more ``build_schedule`` keywords
    (``activation_checkpoint=``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pippy_split.stage.gather_once import kept_modules

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    e = entry(STAGES[schedule])
    tokens, positions = e.args
    half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
    tokens, positions, target = tokens[half], positions[half], e.target[half]
    pipe = ps.pipeline(e.model, e.split_spec, (tokens[:1], positions[:1]))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=e.loss_fn, group=mesh["pp"], **(options or {}))
    kw = {} if how == "per_microbatch" else {"fsdp_gather": how, "gather_budget": budget}
    ps.parallelize(sched, dp_mesh=mesh["dp"], fsdp=["layers.*"], **kw)
    opt = torch.optim.SGD([p for st in sched.stages for p in st.module.parameters()], lr=LR)
    grads, sharded = [], []
    for _ in range(2):
        with _Count() as count:
            sched.step(tokens, positions, target=target)
        sharded.append(_all_sharded(sched.stages))
        grads.append(_stage_grads(sched.stages))
        opt.step()
        opt.zero_grad()
    with _Count() as in_eval:
        with torch.no_grad():
            sched.eval(tokens, positions)
    kept = sorted(f"{st.stage_index}:{name}" for st in sched.stages for name in kept_modules(st.module))
    blocks = sorted(f"{st.stage_index}:{n}" for st in sched.stages for n, _ in st.module.named_modules()
                    if n.startswith("layers.") and n.count(".") == 1)
    return {"grads": grads, "sharded_after_step": sharded, "blocks_sharded_after_eval": _all_sharded(sched.stages, "layers."),
            "gathers": len(count.gathers), "scatters": count.scatters, "eval_gathers": len(in_eval.gathers),
            "kept": kept, "blocks": blocks, "fused": [st.weight_grads_in_input for st in sched.stages],
            "stages": [st.stage_index for st in sched.stages]}


def hand_built(rank: int, world: int, schedule: str, budget) -> dict:
    """Hand-built stages (the first step learns their shapes with a real forward) with
    ``fsdp_gather="once"``: one step, gradients and FSDP2's all-gathers."""
    from tests.dist.nd_bodies import _STAGES, _pp_dp_mesh, _stage_modules, hb_entry
    from tests.dist.nd_bodies import N_MB as HB_MB

    mesh = _pp_dp_mesh()
    e = hb_entry()
    mods = _stage_modules(e.model, schedule, mesh.get_local_rank("pp"), 2)
    stages = [ps.PipelineStage(mods[s], s, _STAGES[schedule], group=mesh["pp"]) for s in sorted(mods)]
    ps.parallelize(stages, dp_mesh=mesh["dp"], fsdp=["layers.*"], fsdp_gather="once", gather_budget=budget)
    sched = ps.get_schedule_class(schedule)(stages, HB_MB, loss_fn=e.loss_fn)
    half = slice(4 * mesh.get_local_rank("dp"), 4 * mesh.get_local_rank("dp") + 4)
    tokens, positions = e.args
    with _Count() as count:
        sched.step(tokens[half], positions[half], target=e.target[half])
    return {"loss": float(sched.loss), "grads": _stage_grads(sched.stages), "gathers": len(count.gathers),
            "sharded": _all_sharded(sched.stages)}
