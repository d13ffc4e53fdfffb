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
# # 03 · Schedules and placement, as plain data
#
# A pipeline schedule answers two questions: which rank holds which stage
# (*placement*), and in what order each rank runs the forward (`F`), backward
# (`B`), or split backward (input grad `I`, weight grad `W`) of each microbatch.
#
# In `pippy_split` the answer is a plain list of actions per rank, computed by a
# pure function with no stages, no process group and no tensors. You can print it,
# simulate it, save it as CSV, edit it, and check it before anything runs. In
# `torch.distributed.pipelining` some schedules are hand-written loops, and listing
# the actions of one means building mock stages.

# %%
import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import (ScheduleError, lower, order_from_csv, order_to_csv, rank_to_stages, simulate,
                                  stage_to_rank, validate)

try:  # a notebook draws a Pipe, a Simulation or a schedule as a table / SVG timeline
    from IPython.display import display
except ImportError:  # plain python without IPython: the same objects as text
    display = print

order = ps.get_schedule_class("1F1B").compute_order(num_ranks=2, n_microbatches=4)
for rank, actions in order.items():
    print(f"rank {rank}:", " ".join(str(a) for a in actions))  # `1B0` = stage 1, backward, microbatch 0

# %% [markdown]
# ## Simulate before you run
#
# `simulate` plays every rank's list together with a cost per action kind and
# reports the makespan, the *bubble* (the fraction of rank time spent idle) and
# the peak number of microbatch activations each rank holds, which is what
# sets activation memory.

# %%
display(simulate(order))  # a notebook draws the timeline; a script prints it as text

# %% [markdown]
# ## Compare the seven schedules
#
# Schedules with two stages per rank cut the model into twice as many, half-size
# stages, so to compare like with like give each of their actions half the cost.
# (Their peak activations then count half-size activations too.) Zero-bubble
# schedules split the backward into `I` (needed by the previous stage now) and
# `W` (can wait) and use the `W`s to fill the bubbles.

# %%
print(f"{'schedule':22} {'placement':9} {'makespan':>8} {'bubble':>7}  peak activations per rank")
for name in ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]:
    cls = ps.get_schedule_class(name)
    spr = 1 if name in ("GPipe", "1F1B") else 2
    c = 1 / spr
    sim = simulate(cls.compute_order(4, 8, spr), costs={"F": c, "I": c, "W": c})
    print(f"{name:22} {cls.placement_style:9} {sim.makespan:8.1f} {sim.bubble_fraction:7.1%}  {sim.peak_activations}")

# %% [markdown]
# ## Loop or V placement
#
# With several stages per rank there are two natural layouts. *Loop* deals stages
# round-robin (rank 0 gets 0 and 4). *V* goes down the ranks and back up (rank 0
# gets 0 and 7). With V the last stage sits beside the first, so the rank given the
# data also computes the loss, and the turn at the bottom (stages 3 → 4) is a local
# hand-off. Placement has one home, `stage_to_rank`, used by stage building,
# lowering and validation alike.

# %%
print("loop:", rank_to_stages(8, 4, "loop"))
print("v:   ", rank_to_stages(8, 4, "v"))
assert stage_to_rank(8, 4, "v")[7] == 0

zbv = simulate(ps.get_schedule_class("ZBVZeroBubble").compute_order(2, 4))
display(zbv)  # inline SVG in a notebook (zbv.to_svg("zbv.svg") writes the same picture to a file)

# %% [markdown]
# ## Lower, save, edit, validate
#
# `lower` inserts the communication each compute action needs (`1RECV_F0` before
# `1F0`, `0SEND_F0` after `0F0`). Pass it the pipe's edges and placement and skip
# connections get their own sends. Orders round-trip through CSV, one row per rank,
# so you can tune one by hand, and `validate` tells you whether the edit still works:
# it dry-runs all ranks together and names the rank, step and action of the first
# problem instead of letting a job hang on a cluster.

# %%
print("rank 1 lowered:", " ".join(str(a) for a in lower(order)[1]))
text = order_to_csv(order)
assert order_from_csv(text) == order

bad = order_from_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")  # rank 1 starts with microbatch 1
try:
    validate(bad, num_stages=2, n_microbatches=2)
except ScheduleError as err:
    print(err)
    print("-> rank", err.rank, "step", err.step, "action", err.action)

# %% [markdown]
# ## Every schedule computes the same gradients, yours included
#
# The order changes speed and memory, never the result. In one process every
# stage lives on rank 0, so the multi-stage-per-rank schedules run as they are;
# a 2-stage pipe is what ZBV and DualPipeV (exactly 2 stages per rank) need here.
# `ps.ScheduleFromOrder` runs a hand-written order (a dict or CSV) after
# validating it on every rank, so a tuned order is one CSV file away.

# %%
entry = zoo.get("mlp_stack")
model, (x,), y = entry.model, entry.args, entry.target
pipe = ps.pipeline(model, ["layers.4"], (x[:2],))  # 2 stages
mine = "0F0,0F1,1F0,1B0,1F1,1B1,0F2,0F3,1F2,1B2,1F3,1B3,0B0,0B1,0B2,0B3\n"  # one rank, both stages
grads = {}
for name in ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "mine"]:
    model.zero_grad(set_to_none=True)  # stage modules share the model's parameters
    if name == "mine":
        stages = [pipe.build_stage(i) for i in range(pipe.num_stages)]
        sched = ps.ScheduleFromOrder(stages, 4, entry.loss_fn, order=mine)
    else:
        sched = ps.build_schedule(pipe, name, n_microbatches=4, loss_fn=entry.loss_fn)
    sched.step(x, target=y)
    grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    print(f"{name:22} loss {sched.loss:.6f}")
for name, g in grads.items():
    for n in g:
        torch.testing.assert_close(g[n], grads["Interleaved1F1B"][n], atol=1e-6, rtol=1e-5)
print("identical gradients under all six orders")

# %% [markdown]
# Next: tutorial 04 puts the stages on real ranks.
