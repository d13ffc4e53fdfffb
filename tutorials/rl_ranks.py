"""Rank body of tutorial 08 (REINFORCE on the trainer), in a module of its own so that a
fresh rank process can import it (a function defined in a notebook cell cannot be)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split import zoo

__all__ = ["reinforce", "GOOD", "PROMPT_LEN", "NEW"]

GOOD = 7  # the toy task: say token 7 as often as possible
PROMPT_LEN, NEW, BATCH, N_MB = 4, 6, 16, 4


def pg_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """REINFORCE: -(advantage x log-probability of each sampled token), summed over the new
    tokens, averaged over rows. ``target`` (b, L, 2): next-token ids and their weight (the
    row's advantage on generated positions, 0 on the prompt)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)  # (b, L-1, V)
    tokens, weight = target[:, 1:, 0].long(), target[:, 1:, 1]  # (b, L-1)
    chosen = logp.gather(2, tokens[..., None])[..., 0]  # (b, L-1)
    return -(chosen * weight).sum(1).mean()


def reinforce(rank: int, world_size: int, iterations: int = 8, schedule: str = "ZBVZeroBubble") -> list[float]:
    """Sample, reward, policy-gradient step, all on one schedule; return the mean reward per iteration."""
    entry = zoo.get("tiny_gpt", seq_len=PROMPT_LEN + NEW)
    model = entry.model
    example = torch.zeros(BATCH // N_MB, PROMPT_LEN + NEW, dtype=torch.long)  # one microbatch of rollouts
    pipe = ps.pipeline(model, entry.split_spec, (example,))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=pg_loss)
    params = [p for st in sched.stages for p in st.module.parameters()]
    opt = torch.optim.Adam(params, lr=3e-2)
    prompts = torch.randint(0, 64, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    rewards = []
    for it in range(iterations):
        out = sched.generate(prompts, max_new_tokens=NEW, do_sample=True, seed=it, return_logprobs=True)
        new = out.sequences[:, PROMPT_LEN:]  # (B, NEW), the same on every rank
        reward = (new == GOOD).float().mean(1)  # (B,)
        advantage = (reward - reward.mean()) / (reward.std() + 1e-6)  # a mean baseline, unit scale
        weight = torch.zeros(BATCH, PROMPT_LEN + NEW)
        weight[:, PROMPT_LEN:] = advantage[:, None]
        target = torch.stack([out.sequences.float(), weight], -1)  # (B, L, 2)
        opt.zero_grad()
        sched.step(out.sequences, target=target)
        opt.step()
        rewards.append(float(reward.mean()))
        if rank == 0:
            print(f"iteration {it}: mean reward {rewards[-1]:.3f}", flush=True)
    return rewards
