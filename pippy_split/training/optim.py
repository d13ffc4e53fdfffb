"""The optimizer side of ``pippy-split train``: learning-rate schedules and gradient accumulation.

Where this sits: called by :mod:`pippy_split.training.loop` once per optimizer step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .config import TrainConfig

if TYPE_CHECKING:
    from ..schedule.pipeline_schedule import PipelineSchedule

__all__ = ["lr_at", "warmup_steps", "average_accumulated", "make_optimizer"]


def make_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """AdamW over ``params`` at ``--lr`` with ``--weight-decay`` (the loop sets each step's lr from the schedule).

    Example:
        >>> opt = make_optimizer(TrainConfig(weight_decay=0.1), [torch.nn.Parameter(torch.ones(2))])
        >>> opt.param_groups[0]["weight_decay"], opt.param_groups[0]["lr"]
        (0.1, 0.003)
    """
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def warmup_steps(cfg: TrainConfig) -> int:
    """``--warmup-steps``, or min(20, steps / 10) (at least 1)."""
    return max(1, cfg.warmup_steps if cfg.warmup_steps is not None else min(20, cfg.steps // 10))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to ``cfg.lr``, then ``cfg.lr_schedule``: cosine or linear decay to 10%, or constant.

    Example:
        >>> cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, lr_schedule="linear")
        >>> [round(lr_at(cfg, s), 3) for s in (0, 9, 10, 55, 99)]
        [0.1, 1.0, 1.0, 0.55, 0.11]
    """
    warm = warmup_steps(cfg)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = (step - warm) / max(1, cfg.steps - warm)
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.lr_schedule == "cosine" else 1 - frac
    return cfg.lr * (0.1 + 0.9 * decay)


def average_accumulated(sched: PipelineSchedule, n: int) -> None:
    """Gradients summed over ``n`` pipeline steps become their mean (each parameter once)."""
    if n == 1:
        return
    params = {id(p): p for st in sched.stages for p in st.module.parameters()}.values()
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.div_(n)
