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
# # 02 · Skip connections across stages
#
# Many models are not a chain. A U-Net's encoder outputs are read again by the
# decoder at the far end of the network; a Llama hands its rotary table to every
# layer. Once the model is cut, such a value has to go from the stage that makes it
# to a stage that is *not* the next one, and in backward its gradient has to come
# back the same way.
#
# `torch.distributed.pipelining` records these values but stops at backward
# ("Backward of skip connections not supported yet"). `pippy_split` keeps one edge
# per reader, always from the true producer: nothing is relayed through the stages
# in between, and each reader's gradient goes straight back to the producer, where
# the contributions are summed.

# %%
import copy

import torch
from torch import nn

import pippy_split as ps
from pippy_split import zoo

try:  # a notebook draws a Pipe, a Simulation or a schedule as a table / SVG timeline
    from IPython.display import display
except ImportError:  # plain python without IPython: the same objects as text
    display = print

entry = zoo.get("tiny_unet")  # denoiser: (8, 3, 16, 16) -> (8, 3, 16, 16), MSE loss
model, (x,), y = entry.model, entry.args, entry.target
reference = copy.deepcopy(model)  # stage modules share the model's parameters; keep an untouched copy

pipe = ps.pipeline(model, ["down2", "up2", "up1"], (x[:2],))  # trace on one microbatch
display(pipe)

# %% [markdown]
# Edges marked `*` skip at least one stage. The stem's output (`silu`) *fans out*:
# stage 0 sends it to stage 1 and, directly, to stage 3. `down1`'s output goes
# from stage 0 to stages 1 and 2. (The summary also warns that the cut is
# unbalanced; `ps.pipeline(model, 4, ...)` would balance it by FLOPs.)

# %%
for e in pipe.edges:
    if e.is_skip:
        print(f"stage {e.src_stage} -> stage {e.dst_stage}: {e.name} {e.spec.shape}")
fan_out = {}
for e in pipe.edges:
    fan_out.setdefault((e.src_stage, e.src_output), []).append(e.dst_stage)
print("readers of stage 0 output 0:", fan_out[(0, 0)])

# %% [markdown]
# ## One training step, checked against the unsplit model
#
# A schedule runs forward and backward microbatch by microbatch. Here all four
# stages sit in this one process (`Interleaved1F1B` with one rank holding every
# stage; stages on the same rank hand values over without communication). On real
# ranks the skip edges become direct sends from stage 0's rank to stage 3's rank.
#
# The check that matters: the gradient of every parameter equals that of the
# unsplit model on the whole batch. The stem's gradient is only right if the
# gradients from *both* of its readers came back and were added.

# %%
sched = ps.build_schedule(pipe, "Interleaved1F1B", n_microbatches=4, loss_fn=entry.loss_fn)
display(sched)  # which stages this rank holds, the placement, and the order's simulated timeline
sched.step(x, target=y)

ref_loss = entry.loss_fn(reference(x), y)  # mean over the batch == mean over 4 equal microbatches
ref_loss.backward()
torch.testing.assert_close(sched.loss, ref_loss.detach())
for stage in sched.stages:
    for name, p in stage.module.named_parameters():  # names are the model's own FQNs
        torch.testing.assert_close(p.grad, reference.get_parameter(name).grad, atol=1e-5, rtol=1e-4)
print(f"loss {sched.loss:.4f}; all gradients match, including the stem's (read by stages 1 and 3)")

# %% [markdown]
# ## When the model cannot be traced: hand-built stages
#
# If `torch.export` cannot trace your model, build the stages yourself and say
# where the skips go. `inputs_from={input: (stage, output)}` and
# `outputs_to={output: [(stage, input)]}` name *stages*, not ranks; the schedule
# maps stages to ranks later, so the same declaration works for any placement.
# You give no shapes: they are learned from the first real microbatch, with no
# extra forward (torch's `PipelineStage`, given no `input_args`, runs one on
# uninitialised memory to find them).


# %%
class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(self.a(x)), self.b(x)  # output 1 skips stage 1


class Mid(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, h):
        return torch.relu(self.l(h))


class Tail(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)

    def forward(self, c, skip):
        return self.l(c * skip)


torch.manual_seed(0)
head, mid, tail = Head(), Mid(), Tail()
stages = [
    ps.PipelineStage(head, 0, 3, "cpu", outputs_to={1: [(2, 1)]}),  # head's output 1 -> tail's input 1
    ps.PipelineStage(mid, 1, 3, "cpu"),  # default: previous stage's outputs, in order
    ps.PipelineStage(tail, 2, 3, "cpu", inputs_from={1: (0, 1)}),  # the same edge, seen from the reader
]
hx, hy = torch.randn(8, 6), torch.randn(8, 3)
manual = ps.ScheduleInterleaved1F1B(stages, 4, loss_fn=nn.functional.mse_loss)
manual.step(hx, target=hy)

with torch.no_grad():
    h, skip = head(hx)
    expected = nn.functional.mse_loss(tail(mid(h), skip), hy)
torch.testing.assert_close(manual.loss, expected)
print(f"hand-built stages: loss {manual.loss:.4f} == unsplit {expected:.4f}")

# %% [markdown]
# Next: tutorial 03 shows how a schedule decides *when* each of these stages
# runs, and on which rank.
