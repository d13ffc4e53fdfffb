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
# # 05 · Dynamic shapes, complex and integer tensors
#
# Two things real language models need from a pipeline that a chain of
# fixed float tensors does not give them:
#
# 1. **A sequence length that changes from batch to batch.** A pipeline stage
#    has to know the shape of what it will receive before it arrives.
#    `torch.distributed.pipelining` allocates its receive buffers from the traced
#    example, so every step must have that shape. Here the edge shapes are
#    *symbolic*, and each step the rank given the data broadcasts the sizes
#    (one tiny message), so every stage sizes its buffers for this batch.
# 2. **Values that are not float activations.** A Llama sends every layer a
#    complex rotary table and the integer positions. Neither has a gradient, and
#    complex is not a type NCCL or gloo know.

# %%
import copy

import torch
from torch.export import Dim

import pippy_split as ps
from pippy_split import zoo

# %% [markdown]
# ## A GPT traced with a dynamic sequence length
#
# Declare the dim with `torch.export`'s `Dim`, keyed by the `forward` argument's
# name. The batch dim stays static: it is the microbatch size, fixed by the
# schedule's `n_microbatches`.

# %%
entry = zoo.get("tiny_gpt")  # positional embeddings cover up to 64 tokens
model, (x,), y = entry.model, entry.args, entry.target  # (8, 32) ids and targets
T = Dim("T", min=2, max=64)
pipe = ps.pipeline(model, entry.split_spec, (x[:2],), dynamic_shapes={"idx": {1: T}})
print(pipe.symbols)  # the symbol torch.export chose and the input dim it is read from
for e in pipe.edges:
    print(e, "| dynamic" if e.spec.is_dynamic else "")

# %% [markdown]
# One schedule, built once, now trains on batches of different lengths:

# %%
reference = copy.deepcopy(model)
sched = ps.build_schedule(pipe, "Interleaved1F1B", n_microbatches=4, loss_fn=entry.loss_fn)
for length in (32, 12):
    xs, ys = x[:, :length], y[:, :length]
    sched.step(xs, target=ys)
    expected = entry.loss_fn(reference(xs), ys)
    torch.testing.assert_close(sched.loss, expected.detach())
    torch.testing.assert_close(pipe(xs[:2]), reference(xs[:2]))
    print(f"T={length}: pipelined loss {sched.loss:.4f} == unsplit {expected:.4f}")

# %% [markdown]
# What was not declared dynamic stays checked: a microbatch of 3 rows is
# refused with a message that says what to do, rather than failing deep
# inside a stage on another rank.

# %%
try:
    pipe(x[:3])
except ValueError as err:
    print(err)

# %% [markdown]
# ## A different length in every microbatch
#
# Language-model batches are rarely rectangular: documents are bucketed by
# length or packed end to end, so the microbatches *of one step* differ. Hand
# the step its microbatches already split, as `ps.Microbatches` (one entry per
# microbatch, for each input and for the target). Each receive is then sized
# for its own microbatch: before the first message, one small all-gather tells
# every rank every microbatch's sizes (never a header on the data channel: NCCL
# pairs sends and receives by order, so a receive must know its size first).
# The outputs come back per microbatch too.

# %%
lengths = [16, 32, 24, 8]
xs = ps.Microbatches(x[2 * k:2 * k + 2, :n] for k, n in enumerate(lengths))
ys = ps.Microbatches(y[2 * k:2 * k + 2, :n] for k, n in enumerate(lengths))
out = sched.step(xs, target=ys)
print([tuple(o.shape) for o in out])  # one output per microbatch, each its own length

expected = sum(entry.loss_fn(reference(xm), ym) for xm, ym in zip(xs, ys)) / len(lengths)
torch.testing.assert_close(sched.loss, expected.detach())
print(f"unequal microbatches {lengths}: loss {sched.loss:.4f} == unsplit {expected:.4f}")

# %% [markdown]
# A length outside the range the pipe was traced for is refused on every rank,
# before any message, naming the microbatch, the input, the dim and the range:

# %%
try:
    too_long = torch.zeros(2, 70, dtype=torch.long)  # the Dim's max is 64
    sched.step(ps.Microbatches([x[:2, :16], x[2:4, :32], too_long, x[6:, :8]]), target=ys)
except ps.PipelineError as err:
    print(err)

# %% [markdown]
# ## Packed documents
#
# `pippy_split.packing` turns a stream of tokenized documents into
# microbatches for a token budget: `pack_documents` puts whole documents end to
# end in one row (no padding; each microbatch its own length), with positions
# that restart at every document and a document id per token. The tiny Llama
# takes them as `positions` and `documents=` (attention stays inside a
# document), read by every stage. With unequal microbatches, average the loss
# over tokens, not microbatches: a summed loss and `loss_count`.

# %%
from pippy_split.packing import pack_documents, step_inputs  # noqa: E402

g = torch.Generator().manual_seed(0)
docs = [torch.randint(1, 64, (int(n),), generator=g) for n in torch.randint(3, 14, (40,), generator=g)]
packed = list(pack_documents(docs, max_tokens=32))[:4]
print([mb.shape for mb in packed], "documents per row:", [int(mb.document_ids.max()) + 1 for mb in packed])


def token_sum_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                                             reduction="sum")


plm = zoo.get("tiny_llama")
T = Dim("T", min=2, max=32)
ppipe = ps.pipeline(plm.model, plm.split_spec, (), {"tokens": packed[0].input_ids,
                    "positions": packed[0].position_ids, "documents": packed[0].document_ids},
                    dynamic_shapes={"tokens": {1: T}, "positions": {1: T}, "documents": {1: T}})
psched = ps.build_schedule(ppipe, "Interleaved1F1B", n_microbatches=4, loss_fn=token_sum_loss,
                           loss_count=lambda t: (t != -100).sum())
ids, pos, doc, tgt = step_inputs(packed, "input_ids", "position_ids", "document_ids", "targets")
plm_ref = copy.deepcopy(plm.model)
psched.step(tokens=ids, positions=pos, documents=doc, target=tgt)
n_tokens = sum(int((t != -100).sum()) for t in tgt)
expected = sum(token_sum_loss(plm_ref(i, p, d), t) for i, p, d, t in zip(ids, pos, doc, tgt)) / n_tokens
torch.testing.assert_close(psched.loss, expected.detach())
print(f"packed: {n_tokens} predicted tokens, loss {psched.loss:.4f} == unsplit {expected:.4f}")

# %% [markdown]
# `python -m benchmarks.packing` measures what this saves against padding every
# document to the longest (see docs/variable_lengths.md for the figures), and
# `pippy-split train --data FILE --pack` trains on the lines of a text file packed
# this way.

# %% [markdown]
# ## Complex and integer values between stages
#
# `TinyLlama.forward(tokens, positions)` looks up its rotary table once,
# `freqs = self.freqs_cis[positions]` (complex64), and hands `freqs` and
# `positions` (int64) to every layer, as torchtitan's Llama does. Cut into four
# stages, both cross every boundary:

# %%
llama = zoo.get("tiny_llama")
tokens, positions = llama.args  # (8, 32) int64 each
lpipe = ps.pipeline(llama.model, llama.split_spec, (tokens[:2], positions[:2]))
for e in lpipe.edges:
    if not e.spec.carries_grad:
        src = "model input" if e.from_input else f"stage {e.src_stage}"
        print(f"{e.name:9} {src:11} -> stage {e.dst_stage}  {e.spec.dtype}  carries_grad={e.spec.carries_grad}")

rotary = [e for e in lpipe.edges if e.spec.dtype == torch.complex64]
pos = [e for e in lpipe.edges if e.spec.dtype == torch.int64]
assert rotary and not any(e.spec.carries_grad for e in rotary)
assert pos and all(e.from_input for e in pos)

# %% [markdown]
# How each is handled:
#
# - **complex64** travels as its real view (`torch.view_as_real`, a float32
#   tensor with a trailing dim of 2) and is viewed back as complex on arrival.
# - **no gradient** is ever sent back along an edge whose `carries_grad` is
#   False: the rotary table is a buffer, positions are integers. Fewer messages,
#   and no zero-filled gradient buffers.
# - **positions is a model input** read by stages 1-3. It goes straight from the
#   rank given the data to each reader (`from_input=True`), not relayed stage to
#   stage; `torch.distributed.pipelining` rejects a model input read by a later
#   stage.
#
# The training step matches the unsplit model:

# %%
lref = copy.deepcopy(llama.model)
lsched = ps.build_schedule(lpipe, "Interleaved1F1B", n_microbatches=4, loss_fn=llama.loss_fn)
lsched.step(tokens, positions, target=llama.target)
expected = llama.loss_fn(lref(tokens, positions), llama.target)
expected.backward()
torch.testing.assert_close(lsched.loss, expected.detach())
for stage in lsched.stages:
    for name, p in stage.module.named_parameters():
        torch.testing.assert_close(p.grad, lref.get_parameter(name).grad, atol=1e-5, rtol=1e-4)
print(f"TinyLlama: loss {lsched.loss:.4f} and every gradient match the unsplit model")
