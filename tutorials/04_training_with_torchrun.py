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
# # 04 · Training on real ranks
#
# So far every stage ran in one process. For real work each rank of a
# `torch.distributed` group holds only its own stages, and the stages pass
# activations forward and gradients back over point-to-point messages.
#
# The training loop below is the **same code on every rank**: no
# `if rank == 0: feed data elif last: compute loss`. Each rank calls
# `sched.step(x, target=y)`; a rank uses what its stages need and ignores the rest.
# With V placement (`ZBVZeroBubble`) rank 0 holds the *first and the last* stage, so
# it uses both the inputs and the targets, while rank 1 uses neither; change the
# schedule or the number of ranks and the loop stays as it is.
#
# This file is a notebook, a script, and a torchrun program: running it as a
# script launches two local ranks with `pippy_split.testing.run_ranks`.

# %%
import os

import torch.distributed as dist


# %% [markdown]
# ## The rank body
#
# Every rank builds the same model (the zoo seeds it, so weights agree), traces
# it on one microbatch, and `build_schedule` keeps only the stages the schedule's
# placement gives this rank. The optimizer sees only those stages' parameters,
# named by their original FQNs.
#
# The body lives in `tutorial_ranks.py` beside this file, not in a cell: a fresh
# rank process finds its function by importing the module that defines it, and a
# function defined in a notebook cell (module `__main__`) cannot be imported. It is
# printed here so you can read it.

# %%
import inspect

from tutorial_ranks import train

print(inspect.getsource(train))


# %% [markdown]
# ## Launch two local ranks from the script
#
# `run_ranks(fn, world_size, *args)` starts fresh processes joined by gloo on CPU,
# calls `fn(rank, world_size, *args)` on each, and returns their results; a rank
# that fails or hangs surfaces its traceback instead of hanging the caller. Ranks
# import `tutorial_ranks` to find `train`; the launch sits under
# `if __name__ == "__main__"` (true in a notebook too) so that torchrun's path below
# stays separate.

# %%
if __name__ == "__main__" and "RANK" not in os.environ:
    from pippy_split.testing import run_ranks

    per_rank = run_ranks(train, 2, 4, timeout=120)
    assert per_rank[0] == per_rank[1]  # both ranks report the same loss
    print("losses:", " ".join(f"{v:.3f}" for v in per_rank[0]))
    assert per_rank[0][-1] < per_rank[0][0], "the loss should fall"

# %% [markdown]
# ## The same body under torchrun (or across nodes)
#
# `torchrun` starts the processes itself and sets `RANK`, `WORLD_SIZE` and the
# rendezvous address; the script then joins the group and calls the same body:
#
# ```bash
# torchrun --nproc-per-node 2 tutorials/04_training_with_torchrun.py
# torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 my_train.py   # across nodes
# ```
#
# With 2 ranks `ZBVZeroBubble` needs 4 stages (2 per rank); with 4 ranks use 8
# stages, or pick a one-stage-per-rank schedule such as `1F1B`. On GPUs pass
# `device=torch.device("cuda", local_rank)` to `build_schedule` and use `nccl`.
#
# The packaged trainer does all of this, plus data, progress bar, sampling and
# checkpoints: `pippy-split train --steps 3 --ranks 2` launches its own ranks
# (through torch's elastic launcher, the machinery behind `torchrun`), and
# `torchrun --nproc-per-node 2 -m pippy_split.train --steps 3` runs the same worker
# under torchrun.

# %%
if __name__ == "__main__" and "RANK" in os.environ:  # started by torchrun
    dist.init_process_group("gloo")
    try:
        train(dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()
