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
# # 08 · Reinforcement learning on the trainer
#
# RL post-training alternates two things: **rollouts** (the policy generates) and a
# **policy-gradient step** on what it generated. Usually the rollouts run in another
# engine, and the trainer's weights are copied ("refit") into it every iteration.
#
# Here both run on **one schedule**: `sched.generate(...)` decodes on the same stages and
# ranks that `sched.step(...)` trains, with the parameters the optimizer just updated (no
# copy). Each stage keeps the KV cache of its own layers; only activations and the new
# tokens cross ranks.
#
# The toy task: the zoo's tiny GPT should say token 7 as often as it can. The reward of a
# rollout is the fraction of its new tokens equal to 7; REINFORCE with a mean baseline
# raises their log-probability where the reward was above average.

# %%
import inspect

from rl_ranks import GOOD, NEW, pg_loss, reinforce

print(inspect.getsource(pg_loss))

# %% [markdown]
# ## The loop, on every rank
#
# Every rank runs the same code. `sched.generate` returns the same sequences on every rank,
# so every rank builds the same targets; `sched.step` uses what its stages need.
# `do_sample=True, seed=it`: row `r`'s token at step `t` comes from a generator seeded from
# `(seed, r, t)`, the same whatever the number of ranks or lanes.

# %%
print(inspect.getsource(reinforce))

# %% [markdown]
# ## Run it on two local ranks
#
# `run_ranks` starts two gloo ranks on this machine (under `torchrun`, call `reinforce` on
# each rank instead). ZBVZeroBubble puts stages 0 and 3 on rank 0, 1 and 2 on rank 1. The
# launch sits under `if __name__ == "__main__"` (true in a notebook too): a rank process
# imports `rl_ranks`, never this file.

# %%
if __name__ == "__main__":
    from pippy_split.testing import run_ranks

    per_rank = run_ranks(reinforce, 2, timeout=300)
    assert per_rank[0] == per_rank[1]  # every rank saw the same rollouts and rewards
    rewards = per_rank[0]
    print("mean reward per iteration:", [round(r, 3) for r in rewards])

# %% [markdown]
# The reward rises: the policy learned, on the trainer, from its own rollouts.

# %%
if __name__ == "__main__":
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"first iterations {first:.3f} -> last iterations {last:.3f} (token {GOOD}, {NEW} new tokens per row)")
    assert last > first + 0.1, (first, last)
