"""Rank bodies: selective activation checkpointing on Hugging Face models built from tiny configs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pippy_split as ps

N_MB = 2


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out["logits"]


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hf_reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    from tests.models.hf import build

    model = build(name)[0]
    ids, target = _inputs()
    total = 0.0
    for x, t in zip(ids.chunk(N_MB), target.chunk(N_MB)):
        loss = lm_loss(model(x), t) / N_MB
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def hf_selective_step(rank: int, world: int, name: str, schedule: str, stages: int, patterns: list[str]):
    from tests.models.hf import build

    model = build(name)[0]
    ids, target = _inputs()
    pipe = ps.pipeline(model, stages, ids[: 4 // N_MB])
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=lm_loss, activation_checkpoint=patterns)
    sched.step(ids, target=target)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "counts": [st.region_counts for st in sched.stages]}
