"""``pippy-split train --plan 2GB``: let :func:`pippy_split.plan` choose how the run is pipelined.

Where this sits: before :func:`pippy_split.training.setup.prepare`, on every rank.
Every rank builds the run's model (same seed) and calls ``ps.plan`` with one
microbatch of the run's data; every rank gets rank 0's plan, so all ranks take the
same choice. The best fitting candidate whose cuts fall where modules begin
(``--split`` takes module FQNs) sets ``--schedule``, ``--microbatches``, ``--split``
and ``--activation-checkpoint``; the run then goes on as if they had been given.

Example:
    >>> cfg = TrainConfig(plan="1GB", steps=10)
    >>> cfg.plan
    '1GB'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

import pippy_split as ps

from .config import TrainConfig
from .errors import JobError
from .setup import model_source, stages_per_rank

__all__ = ["planned_config", "config_of_candidate"]


def config_of_candidate(cfg: TrainConfig, candidate: Any) -> TrainConfig:
    """``cfg`` with the candidate's schedule, microbatches, split (module FQNs) and checkpointing."""
    return dataclasses.replace(cfg, plan=None, schedule=candidate.schedule, microbatches=candidate.n_microbatches,
                               split=",".join(candidate.split.cut_fqns),
                               activation_checkpoint="full" if candidate.activation_checkpoint else None)


def planned_config(cfg: TrainConfig, world: int, log: Callable[..., None]) -> TrainConfig:
    """Plan the run under ``cfg.plan`` bytes per rank and return the config that runs the plan's best."""
    assert cfg.plan is not None
    prep, _, ex_args, ex_kwargs = model_source(cfg, world * stages_per_rank(cfg.schedule))
    if any(p.is_meta for p in prep.model.parameters()):
        raise JobError("--plan profiles the model, which a pretrained directory builds on meta (each rank fills "
                         "only its stages): plan on the config alone (hf:config.json), then train with the split "
                         "it prints")
    target = torch.zeros_like(ex_args[0]) if prep.vocab_size is not None or prep.gpt_cfg is not None else \
        _first_microbatch(prep.target, ex_args[0].shape[0])
    plan = ps.plan(prep.model, ex_args, example_kwargs=ex_kwargs or None, example_target=target, num_ranks=world,
                   memory_budget=cfg.plan, loss_fn=prep.loss_fn, global_batch=prep.batch_size)
    named = [c for c in plan.fitting if c.split.cut_fqns and None not in c.split.cut_fqns]
    if not named:
        raise JobError(f"--plan {cfg.plan}: no fitting candidate cuts where modules begin (--split takes module "
                         f"FQNs); the plan's best is {plan.best}. Build it in Python: plan.best.build_schedule()")
    choice = named[0]
    if plan.too_noisy:
        log(f"[yellow]{plan.noise_message}")
    skipped = "" if choice is plan.best else f" (the best, {plan.best}, cuts inside a module)"
    log(f"[bold]plan[/] under {cfg.plan} per rank: {choice}{skipped}")
    return config_of_candidate(cfg, choice)


def _first_microbatch(target: Any, size: int) -> Any:
    return target[:size] if isinstance(target, torch.Tensor) else target
