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
# # 09 · A torchtitan model on pippy_split
#
# [torchtitan](https://github.com/pytorch/torchtitan) builds pipeline stages from a hand-written
# list of module names per stage and runs them with `torch.distributed.pipelining`. Its
# extension point is the `pipelining_fn` of a `ModelSpec`, which the Trainer calls with the
# model it built on `meta`. pippy_split answers it two ways:
#
# - **`pippy_split.integrations.torchtitan.pipeline_llm`**: the same signature and return value
#   as torchtitan's own, but the model is traced and cut where the cost balances (no FQN lists),
#   under any schedule, V-shaped ones and DualPipeV included;
# - **`pippy_split.integrations.torchtitan_compat.compat_pipeline_llm`**: torchtitan's own
#   `pipeline_llm` (its FQN lists, its `_split_module`), with the stages and schedule taken from
#   `pippy_split.compat` instead of `torch.distributed.pipelining`.
#
# This tutorial takes torchtitan's own Llama 3 class at a tiny size, replays on 2 CPU ranks the
# calls the Trainer makes (its Trainer has no CPU path) and checks the loss and every gradient
# against the unsplit model. It needs `pip install "pippy-split[torchtitan]"` (and on a CPU
# machine `pip install --no-deps triton==3.8.0`: torchtitan imports triton); without torchtitan it
# says so and stops.

# %%
import importlib.util
import sys

if importlib.util.find_spec("torchtitan") is None:
    print("torchtitan is not installed: pip install 'pippy-split[torchtitan]' (and --no-deps triton==3.8.0 "
          "on CPU) to run this tutorial")
    sys.exit(0)

import torch
from titan_ranks import BATCH, SEQ, model_spec, trainer_sequence  # the rank body, beside this file

from pippy_split.testing import run_ranks

# %% [markdown]
# ## What changes in a torchtitan config
#
# One field of the model spec. torchtitan 0.3.0's registries return a `ModelSpec`; replace its
# `pipelining_fn` (here `titan_ranks.model_spec` does exactly this, with a tiny Llama 3):
#
# ```python
# import dataclasses
# from torchtitan.models.llama3 import model_registry
# from pippy_split.integrations.torchtitan import pipeline_llm
#
# spec = dataclasses.replace(model_registry("8B"), pipelining_fn=pipeline_llm)
# ```
#
# In the job's `ParallelismConfig`, `module_fqns_per_model_part` and the
# `pipeline_parallel_{first,last}_stage_less_layers` weights are no longer needed (given, the
# first module of each part starts a stage); `pipeline_parallel_schedule` may be any of
# pippy_split's names. `pipeline_parallel_degree`, `pipeline_parallel_microbatch_size` and
# `pipeline_parallel_layers_per_stage` mean what they meant. The model's `parallelize_fn` runs on
# each stage as on a model part: FSDP2, tensor parallelism (`tensor_parallel_degree`, sequence
# parallel or not), full AC and per-block `torch.compile` (docs/torchtitan.md says how TP crosses a
# cut). Refused by name: context parallelism, `pipeline_parallel_schedule_csv` and
# `enable_weight_tying` (torchtitan refuses the last with PP itself).

# %%
spec = model_spec()
print(spec.name, "pipelining_fn:", spec.pipelining_fn.__module__ + "." + spec.pipelining_fn.__name__)

# %% [markdown]
# ## The Trainer's calls, on 2 ranks
#
# Each rank builds the model on `meta`, calls `spec.pipelining_fn(model, parallel_dims=...,
# training=..., parallelism=..., ...)`, then on each returned part `to_empty(device=...)` and
# `init_weights(buffer_device=None)` (which computes the rope cache), and finally the Trainer's
# step call, `step(arg_mbs=, kwarg_mbs=, target_mbs=, losses=, loss_kwargs=, return_outputs=False)`.
# To compare with the unsplit model, the parts take its weights after `init_weights`, as they
# would from a seed checkpoint.

# %%
torch.manual_seed(0)
unsplit = spec.model.build()
unsplit.init_weights()
weights = {n: p.detach() for n, p in unsplit.named_parameters()}
g = torch.Generator().manual_seed(1)
tokens = torch.randint(0, 64, (BATCH, SEQ), generator=g)
labels = torch.randint(0, 64, (BATCH, SEQ), generator=g)

per_rank: list[dict] = []  # a rank process imports this file too (as __mp_main__): it runs no ranks itself
if __name__ == "__main__" or "ipykernel" in sys.modules:
    per_rank = run_ranks(trainer_sequence, 2, "ZBVZeroBubble", tokens, labels, weights, timeout=100)

# %% [markdown]
# ZBVZeroBubble places stages in a V: rank 0 holds the first and the last stage. The cuts were
# chosen by cost, and each part keeps the model's own names (`layers.3`, `lm_head`, ...).

# %%
for rank, r in enumerate(per_rank):
    print(f"rank {rank}: {r['schedule']}, stages {r['stages']}, modules {r['modules']}")

# %% [markdown]
# ## Equal to the unsplit model
#
# torchtitan's loss is the sum of token losses over the global count of valid tokens; the schedule
# is built with `scale_grads=False`, as torchtitan builds its own, so the per-microbatch losses
# add up to the whole batch's loss and the gradients are the unsplit model's.

# %%
if per_rank:
    ref = torch.nn.functional.cross_entropy(unsplit(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
    ref = ref / labels.numel()
    ref.backward()
    loss = next(r["loss"] for r in per_rank if r["loss"] is not None)
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=0)
    grads = {n: g for r in per_rank for n, g in r["grads"].items()}
    for n, p in unsplit.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=0)
    print(f"loss {loss.item():.5f} == unsplit {ref.item():.5f}; {len(grads)} gradients equal")

# %% [markdown]
# ## The other route: torchtitan's own split on pippy_split.compat
#
# `compat_pipeline_llm` runs torchtitan's `pipeline_llm` unmodified, its names
# `PipelineStage`, `get_schedule_class`, `PipelineScheduleSingle/Multi`, ... pointing at
# `pippy_split.compat` for the call. Use it to keep torchtitan's FQN lists while the schedule
# is pippy_split's:
#
# ```python
# from pippy_split.integrations.torchtitan_compat import compat_pipeline_llm
# spec = dataclasses.replace(model_registry("8B"), pipelining_fn=compat_pipeline_llm)
# ```
#
# Both routes are tested against torchtitan itself (Llama 3, Qwen3, DeepSeek-V3, 2 and 4 ranks,
# PP x FSDP2) in `tests/torchtitan/`; `docs/torchtitan.md` lists every call the Trainer makes
# into the pipelining API and how it is answered.
