# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · PP x FSDP2 x TP on a device mesh
#
# Pipeline parallelism cuts the model into stages along its depth. Two more ways to
# divide the work combine with it:
#
# - **data parallelism with FSDP2** (`fully_shard`): replicas run different rows of
#   the batch; each block's parameters are sharded over the replicas, all-gathered
#   just before the block runs and its gradients reduce-scattered after;
# - **tensor parallelism** (`parallelize_module`): the matrices inside a block are
#   split by columns or rows over a few ranks, which all run the same rows.
#
# This tutorial combines them on 4 CPU ranks (gloo): PP2 x FSDP2, then PP2 x TP2 (all
# three at once on 8 ranks, with the same code), with pippy_split's traced stages,
# under `1F1B` and `ZBVZeroBubble`, and asserts that the loss and every gradient equal
# the unsplit model's on the same global batch. It runs as a script
# (4 local ranks), as a notebook, and under
# `torchrun --nproc-per-node 4 tutorials/07_nd_parallelism.py`.

# %%
import inspect
import math
import os

import torch
import torch.distributed as dist
from tutorial_ranks import nd_step, nd_tour  # the rank bodies, beside this file (see below)

# %% [markdown]
# ## A DeviceMesh: the ranks as an n-D grid
#
# `init_device_mesh("cuda", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))` lays the
# `pp * dp * tp` ranks out as a grid, row-major (rank = `(i_pp * dp + i_dp) * tp + i_tp`),
# and makes one process group per line of the grid along each dimension: `mesh["tp"]`
# on a rank is the group of ranks that differ from it only in their tp index, and so
# on. Every rank belongs to exactly one group of each dimension.
#
# The order is chosen by how much each kind of parallelism talks. TP exchanges
# activations inside every block, so it is innermost: its ranks are neighbours (one
# node, fastest links). FSDP2 gathers parameters and reduces gradients block by block.
# PP only sends activations between stages, point to point, so it is outermost and
# crosses nodes. The groups, drawn with plain tensors (no processes needed):

# %%
def groups(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The process groups of mesh dimension ``dim``: rank numbers that differ only along it."""
    grid = torch.arange(math.prod(shape)).reshape(shape)
    return grid.movedim(dim, -1).reshape(-1, shape[dim]).tolist()


SHOW = os.environ.get("RANK", "0") == "0"  # under torchrun, print the notebook's cells once

for shape in [(2, 2, 2), (2, 2, 1), (2, 1, 2)]:
    if SHOW:
        print(f"{math.prod(shape)} ranks as (pp, dp, tp) = {shape}:")
        for dim, name in enumerate(("pp", "dp", "tp")):
            print(f"  {name} groups: {groups(shape, dim)}")

# %% [markdown]
# On 8 ranks, `(2, 2, 2)` uses every piece at once: 2 pipeline stages, 2 FSDP2
# replicas, 2-way TP. With 4 processes we run the **same code** on two shapes:
# `(2, 2, 1)` (PP2 x FSDP2) and `(2, 1, 2)` (PP2 x TP2, one replica); a dimension of
# size 1 has nothing to divide, and its parallelism is skipped. Only the shape changes:
# under `torchrun --nproc-per-node 8` this script takes `(2, 2, 2)`, and runs it.
#
# ## The rank body
#
# `nd_step` is what every rank runs. Read it top to bottom:
#
# 1. **The mesh**, `init_device_mesh("cpu", shape, ("pp", "dp", "tp"))`.
# 2. **The reference**: the unsplit tiny Llama (the zoo seeds it, so every rank builds
#    the same weights and batch), forward and backward on the whole global batch of 8.
# 3. **This replica's rows**: data-parallel replica `i` runs rows `4i .. 4i+3` (with
#    `dp=2`); TP ranks of one replica run the same rows. Each replica splits its rows
#    into 2 microbatches.
# 4. **Trace and build**: `ps.pipeline` traces the model on one microbatch;
#    `ps.build_schedule(..., group=mesh["pp"])` keeps the stages this rank's pipeline
#    index holds (V placement for `ZBVZeroBubble`: 4 stages, 2 per rank).
# 5. **Your modules inside the stage**: a traced stage is a graph of traced glue ops and
#    `call_module` nodes that call *your own* module objects under their FQNs, for
#    every module call the cut does not enter, so
#    `st.module.get_submodule("layers.1") is model.layers[1]`. That is why the next step
#    works: a hook, `fully_shard` or a TP style on `model.layers[1]` is what runs.
# 6. **Parallelize**: `ps.parallelize(sched, tp_mesh=mesh["tp"], tp_plan=...,
#    dp_mesh=mesh["dp"], fsdp=["layers.*"])` calls torch's `parallelize_module` with a
#    Megatron-style plan (q, k, v and w1, w3 split by columns, o and w2 by rows: one
#    all-reduce per attention and one per MLP), then `fully_shard` on each block the
#    pattern names and on the stage root (embedding, final norm, output head). The
#    patterns are relative to the stage module; a rank without `layers.3` is fine.
#    A mesh dimension of size 1 is left out. `by_hand=True` does the same with plain
#    torch calls: TP on your blocks before `build_schedule` (see below why), FSDP2
#    block by block after it.
# 7. **One step**, the same call on every rank: `sched.step(tokens, positions, target=...)`
#    with this replica's rows.
# 8. **Exactness**: the replicas' mean loss must equal the unsplit loss; every gradient,
#    gathered into a whole tensor with `.full_tensor()` (FSDP2 has already averaged it
#    over the replicas), must equal the unsplit model's within `1e-5`; and together the
#    pipeline ranks must cover every parameter.
#
# The body lives in `tutorial_ranks.py` beside this file, as in tutorial 04: a rank
# process finds its function by importing it, which it cannot do from a notebook cell.

# %%
if SHOW:
    print(inspect.getsource(nd_step))

# %% [markdown]
# ## `ps.parallelize` or plain torch
#
# `ps.parallelize` adds no machinery of its own: it resolves the FQN patterns against
# this rank's stage modules, refuses by name a pattern that names a module a split
# point enters (that module runs as traced ops, where neither a hook nor a style would
# take effect), and calls `parallelize_module` and `fully_shard`. By hand
# (`nd_step(..., by_hand=True)`) it is the loop you would write for an unsplit model,
# over the blocks this rank's stages call:
#
# ```python
# for st in sched.stages:
#     for name in ["layers.0", "layers.1"]:                          # the blocks st calls
#         fully_shard(st.module.get_submodule(name), mesh=mesh["dp"])  # is model.layers[i]
#     fully_shard(st.module, mesh=mesh["dp"])                        # embedding, norm, head
# ```
#
# Both routes are checked against the unsplit model below, and agree with it to
# within float rounding.
#
# ## Zero-bubble schedules: when the I/W split survives
#
# `ZBVZeroBubble` splits each backward into I (input gradients, on the critical path)
# and W (weight gradients, run later to fill bubbles). Two things decide whether a
# stage keeps that split; each run below prints what the library warned about.
#
# - **FSDP2**: FSDP2 reduce-scatters a block's gradients when the backward reaches the
#   block's inputs, which is in I, before a separate W could add to them. A stage
#   holding FSDP2 runs its whole backward in I: exact, without the overlap for that
#   stage, and a warning per stage says so.
# - **TP keeps it**, whenever you apply it: `parallelize_module` replaces each `Linear`
#   weight with a new DTensor parameter under the same name, and the split's plan follows
#   the parameters by name, so TP applied *after* `build_schedule` (as
#   `ps.parallelize(sched, ...)` is, since it takes the built stages) keeps the split, as
#   does TP applied *before* it on your own blocks (`parallelize_module(model.layers[i],
#   ...)` between `ps.pipeline` and `build_schedule`: the stages call those very objects).
#   Both TP runs below warn of nothing.

# %% [markdown]
# ## Run it: four local ranks
#
# `nd_tour` runs `nd_step` once per entry of a list of `(shape, schedule, by_hand)`,
# in one set of rank processes (starting processes costs more than a step here), and
# rank 0 prints a line per run. `run_ranks` starts 4 fresh processes joined by gloo.

# %%
def runs_for(world_size: int) -> list[tuple]:
    """The runs this tutorial makes: every piece on 8 ranks; on 4, FSDP2 and TP in turn."""
    if world_size == 8:
        return [((2, 2, 2), "1F1B", False), ((2, 2, 2), "ZBVZeroBubble", True)]
    if world_size == 4:
        return [((2, 2, 1), "1F1B", False), ((2, 2, 1), "ZBVZeroBubble", True),      # PP2 x FSDP2
                ((2, 1, 2), "1F1B", False), ((2, 1, 2), "ZBVZeroBubble", False),     # PP2 x TP2
                ((2, 1, 2), "ZBVZeroBubble", True)]
    raise SystemExit(f"this tutorial runs on 4 or 8 ranks, not {world_size}")


if __name__ == "__main__" and "RANK" not in os.environ:
    from pippy_split.testing import run_ranks

    per_rank = run_ranks(nd_tour, 4, runs_for(4), timeout=150)
    for run, results in zip(runs_for(4), zip(*per_rank)):
        assert all(abs(r["loss"] - r["ref_loss"]) < 1e-5 for r in results), run
        assert all(r["max_diff"] < 1e-5 for r in results), run
    # rank 0 holds the first pipeline stage: its graph calls the embedding and the first blocks
    assert per_rank[0][0]["called"][0][:3] == ["tok_embeddings", "layers.0", "layers.1"]
    warned = [bool(r["warnings"]) for r in per_rank[0]]
    # ZBV keeps its I/W split with TP; a stage holding FSDP2 runs its whole backward in I (warned)
    assert warned == [False, True, False, False, False], warned
    print(f"all {len(warned)} runs exact on all 4 ranks")

# %% [markdown]
# ## The same file under torchrun
#
# `torchrun` starts the processes itself and sets `RANK`, `WORLD_SIZE` and the
# rendezvous; the script joins the group and calls the same body:
#
# ```bash
# torchrun --nproc-per-node 4 tutorials/07_nd_parallelism.py   # (2, 2, 1) and (2, 1, 2)
# torchrun --nproc-per-node 8 tutorials/07_nd_parallelism.py   # (2, 2, 2): PP2 x FSDP2 x TP2
# ```
#
# On GPUs: `init_device_mesh("cuda", ...)`, the `nccl` backend, and
# `device=torch.device("cuda", local_rank)` for `build_schedule`. Across nodes keep
# `tp` within a node (it is innermost, so it is when `tp` divides the GPUs per node).
# To train rather than check, drop the reference and the asserts, build the optimizer
# over `[p for st in sched.stages for p in st.module.parameters()]` *after*
# `ps.parallelize` (the parameters are DTensors from then on), and clip with
# `ps.clip_grad_norm_(sched, max_norm)`, which reduces over the pipeline group and the
# gradients' own mesh.

# %%
if __name__ == "__main__" and "RANK" in os.environ:  # started by torchrun
    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        nd_tour(dist.get_rank(), dist.get_world_size(), runs_for(dist.get_world_size()))
    finally:
        dist.destroy_process_group()
