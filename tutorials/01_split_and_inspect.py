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
# # 01 · Split a model and look inside
#
# Pipeline parallelism cuts one model into *stages* that run on different ranks.
# Before anything runs on a rank you want to know what the cut did: which
# modules landed in which stage, what each stage costs, and which values have to
# travel between stages. `pippy_split` traces the model once with `torch.export`
# and answers all three from the graph.
#
# Run it as a script (`python tutorials/01_split_and_inspect.py`) or open it as
# a notebook (`jupytext --to notebook`).

# %%
import torch

import pippy_split as ps
from pippy_split import zoo

try:  # a notebook draws a Pipe, a Simulation or a schedule as a table / SVG timeline
    from IPython.display import display
except ImportError:  # plain python without IPython: the same objects as text
    display = print

entry = zoo.get("tiny_gpt")  # a 4-block character GPT and an example batch
model, (x,), y = entry.model, entry.args, entry.target
print(tuple(x.shape), "token ids ->", tuple(model(x).shape), "logits")

# %% [markdown]
# ## Trace with ONE microbatch
#
# The example you trace with is a *microbatch*, not the whole batch: the shapes
# on the edges between stages are recorded from it, and a schedule later feeds
# each stage exactly that shape. (The batch dim stays static unless you declare
# it dynamic, see tutorial 05.) With 8 rows and 4 microbatches, trace on 2 rows.

# %%
mb = x[:2]  # (2, 32)
pipe = ps.pipeline(model, ["blocks.1", "blocks.2", "blocks.3"], (mb,))
display(pipe)

# %% [markdown]
# The first table is the stages: module ranges, parameters, FLOPs per
# microbatch and who talks to whom, so an unbalanced cut shows up before a
# single step runs. The second is `pipe.edges`, one row per value that crosses
# a cut. Edges are plain data you can use in code:

# %%
for e in pipe.edges:
    print(e.src_stage, "->", e.dst_stage, e.name, e.spec.shape, e.spec.dtype, "grad" if e.spec.carries_grad else "")

# %% [markdown]
# ## Four ways to say where to cut
#
# A list of FQNs cuts at the *beginning* of each; a dict chooses the side; an
# int lets the splitter balance stages (by FLOPs, or `balance="params" | "time" | "memory"`);
# `None` uses `ps.pipe_split()` calls you put in `forward` (handy when the cut
# is not at a module boundary). `torch.distributed.pipelining` takes the dict
# and the marks, plus a `split_policy` callable over the FX graph; the list
# and the int are the short forms you usually want.

# %%
by_dict = ps.pipeline(model, {"blocks.1": ps.SplitPoint.END}, (mb,))  # cut after blocks.1
balanced = ps.pipeline(model, 2, (mb,))
print("dict:", by_dict.num_stages, "stages; int:", balanced.num_stages, "stages")


class TwoHalves(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        ps.pipe_split()  # everything below runs in the next stage (a no-op when run eagerly)
        return self.b(h * 2)


print("pipe_split marks:", ps.pipeline(TwoHalves(), None, (torch.randn(2, 8),)).num_stages, "stages")

# %% [markdown]
# ## A Pipe is still the model
#
# `pipe(...)` runs every stage in this process, in order. It is the quickest
# check that the cut changed nothing. Each stage module keeps the model's own
# parameter names, so its `state_dict()` lines up with the unsplit model's, which
# is what makes checkpoints portable across layouts (tutorial 06).

# %%
torch.testing.assert_close(pipe(mb), model(mb))
print(list(pipe.get_stage_module(1).state_dict())[:3])

# %% [markdown]
# ## A Hugging Face Llama, built from a config
#
# Real models pass more than activations between layers. An HF Llama hands every
# decoder layer the rotary `cos`/`sin` tables and a causal mask, so these values
# cross every cut. In the edge table they are marked `no grad`: a float
# value that carries no gradient (the tables) and a `bool` mask never get a gradient
# sent back. `torch.distributed.pipelining` sends a gradient buffer for every float
# edge, and refuses HF causal LMs until you set `use_cache=False`; here the
# cache object is dropped from the traced output and the default config works.
# No weights are downloaded: a tiny config is enough to see the structure.

# %%
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
llama = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, cfg.vocab_size, (2, 16))  # one microbatch: (2, 16)
hf_pipe = ps.pipeline(llama, ["model.layers.2"], (ids,))
display(hf_pipe)
out = hf_pipe(ids)  # the same CausalLMOutputWithPast the model returns
torch.testing.assert_close(out.logits, llama(ids).logits)
print(type(out).__name__, tuple(out.logits.shape))

# %% [markdown]
# Next: tutorial 02 looks at edges that skip stages (a U-Net), and how their
# gradients find the way back.
