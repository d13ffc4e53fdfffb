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
# # 06 · Checkpoints that outlive the layout
#
# A pipeline layout (how many stages, on how many ranks, with which schedule)
# changes over a model's life: you debug on 2 ranks, train on 16, evaluate the
# plain model on one GPU. A checkpoint should not care.
#
# Every stage module here keeps the model's own parameter names, so the stages'
# state dicts, taken together, *are* the model's state dict. `pippy_split.checkpoint`
# writes them with `torch.distributed.checkpoint` (DCP), which reads back by key:
# whatever layout wrote a checkpoint, every other layout finds its keys. With
# `torch.distributed.pipelining` there is no checkpoint helper; saving and
# renaming stage parameters across layouts is left to you.

# %%
import os
import shutil
import tempfile

import torch

import pippy_split as ps
from pippy_split import checkpoint, zoo

workdir = tempfile.mkdtemp(prefix="pippy_split_tutorial_")
entry = zoo.get("tiny_gpt")
(x,), y, loss_fn = entry.args, entry.target, entry.loss_fn


def params_of(sched):
    """This rank's parameters: those of its stages (a tied weight only once)."""
    return list({id(p): p for st in sched.stages for p in st.module.parameters()}.values())


# %% [markdown]
# ## Train a 4-stage pipeline, then save
#
# Here one process holds all four stages; on real ranks the call is the same on
# every rank, and each rank writes only the keys its stages hold. The optimizer
# state is stored by parameter name too, and `extra` takes anything picklable
# (step count, data position). The write goes to a temporary sibling directory
# that replaces the old checkpoint only once every rank has finished, so a job
# killed mid-save leaves the previous checkpoint loadable.

# %%
pipe4 = ps.pipeline(entry.model, entry.split_spec, (x[:2],))
sched4 = ps.build_schedule(pipe4, "Interleaved1F1B", n_microbatches=4, loss_fn=loss_fn)
opt4 = torch.optim.AdamW(params_of(sched4), lr=1e-2)
for step in range(2):
    opt4.zero_grad()
    sched4.step(x, target=y)
    opt4.step()

ckpt = os.path.join(workdir, "step2")
checkpoint.save(ckpt, sched4, opt4, extra={"step": 2})
logits_at_save = entry.model(x[:2]).detach()  # the stages share the model's parameters
print(sorted(os.listdir(ckpt)))
assert checkpoint.saved_keys(ckpt) == sorted(entry.model.state_dict())  # just the model's own names
print(checkpoint.saved_keys(ckpt)[:4], "...")

# %% [markdown]
# ## Load it into other layouts
#
# The test of a checkpoint is whether training continues exactly. Take one more
# step three ways: in the 4-stage pipeline that wrote it, in the unsplit model,
# and in a 2-stage pipeline with another split and schedule. The loaded models
# start from other random weights and another learning rate; weights, AdamW
# moments and the learning rate all come from the checkpoint.

# %%
opt4.zero_grad()
sched4.step(x, target=y)
opt4.step()
losses = {"4 stages (writer)": float(sched4.loss)}

plain = zoo.get("tiny_gpt", seed=1).model  # unsplit, other weights
opt_plain = torch.optim.AdamW(plain.parameters(), lr=0.5)
print("extra:", checkpoint.load(ckpt, plain, opt_plain))
loss = loss_fn(plain(x), y)
loss.backward()
opt_plain.step()
losses["unsplit model"] = loss.item()

other = zoo.get("tiny_gpt", seed=2).model
pipe2 = ps.pipeline(other, ["blocks.2"], (x[:2],))  # 2 stages, another cut
sched2 = ps.build_schedule(pipe2, "ZBVZeroBubble", n_microbatches=4, loss_fn=loss_fn)
opt2 = torch.optim.AdamW(params_of(sched2), lr=0.5)
checkpoint.load(ckpt, sched2, opt2)
sched2.step(x, target=y)
opt2.step()
losses["2 stages, ZBV"] = float(sched2.loss)

for layout, value in losses.items():
    print(f"{layout:18} step 3 loss {value:.6f}")
    assert abs(value - losses["4 stages (writer)"]) < 1e-5
for name, p in plain.named_parameters():  # and the step landed in the same place
    torch.testing.assert_close(p, entry.model.get_parameter(name), atol=1e-5, rtol=0)

# %% [markdown]
# ## A model bigger than one rank
#
# Build the model on the `meta` device (no memory), trace and split it as usual,
# and let each rank materialize only its own stages; then fill them from the
# checkpoint. A stage holds the model's own modules, so building it allocates exactly
# those modules' tensors, inside the model too. `build_schedule` does the building on
# a real rank; here we build all four stages by hand to see that each allocates only
# its share.

# %%
from pippy_split.zoo.gpt import TinyGPT  # noqa: E402

with torch.device("meta"):
    big = TinyGPT()  # same sizes as the zoo's tiny_gpt
meta_pipe = ps.pipeline(big, entry.split_spec, (x[:2],))
stages = []
for i in range(meta_pipe.num_stages):
    stages.append(meta_pipe.build_stage(i, "cpu"))
    allocated = sum(p.numel() for p in big.parameters() if not p.is_meta)
    print(f"stage {i}: {sum(p.numel() for p in stages[-1].module.parameters()):6d} parameters; "
          f"allocated in the model so far: {allocated}")
    assert allocated == sum(p.numel() for st in stages for p in st.module.parameters())  # never more
checkpoint.load(ckpt, stages)
torch.testing.assert_close(meta_pipe(x[:2]), logits_at_save, atol=1e-5, rtol=0)
print("the meta-built pipe, filled from the checkpoint, computes what the saved model did")

# %% [markdown]
# ## Loading the wrong checkpoint is an error that says why
#
# Keys that the model needs and the checkpoint lacks, and keys the checkpoint holds
# that no stage has, are listed (raised on every rank alike, never a hang). Pass
# `strict=False` to load what matches and get the same report as a warning.

# %%
try:
    checkpoint.load(ckpt, zoo.get("mlp_stack").model)
except checkpoint.CheckpointError as err:
    print(str(err)[:300], "...")
    print(len(err.missing), "missing,", len(err.unexpected), "unexpected")

shutil.rmtree(workdir)
