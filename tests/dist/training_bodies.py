"""Rank bodies for the training-kit dist tests: token-normalised losses, gradient clipping."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pippy_split as ps
from pippy_split import zoo

N_MB = 4


def padded_batch():
    """tiny GPT batch whose microbatches hold very different numbers of valid tokens."""
    entry = zoo.get("tiny_gpt")
    x, target = entry.args[0], entry.target.clone()
    valid = [32, 3, 17, 0, 25, 32, 1, 9]  # per sample; microbatch 1 (samples 2, 3) has 17 tokens
    for i, n in enumerate(valid):
        target[i, n:] = -100
    return entry, x, target


def sum_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")


def valid_tokens(target):
    return (target != -100).sum()


def token_reference():
    entry, x, target = padded_batch()
    loss = F.cross_entropy(entry.model(x).flatten(0, 1), target.flatten(), ignore_index=-100)  # mean over valid
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in entry.model.named_parameters()}


def token_step(rank: int, world: int, schedule: str, steps: int = 1):
    entry, x, target = padded_batch()
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],))
    sched = ps.build_schedule(pipe, schedule, N_MB, loss_fn=sum_loss, loss_count=valid_tokens)
    for _ in range(steps):
        sched.step(x, target=target)
    grads = {n: p.grad.clone() for st in sched.stages for n, p in st.module.named_parameters() if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads}


def zero_items_step(rank: int, world: int):
    entry, x, target = padded_batch()
    target[:] = -100
    pipe = ps.pipeline(entry.model, entry.split_spec, (x[:2],))
    sched = ps.build_schedule(pipe, "1F1B", N_MB, loss_fn=sum_loss, loss_count=valid_tokens)
    try:
        sched.step(x, target=target)
    except ps.PipelineError as e:
        return str(e)
    return None


def clip_reference(name: str, n_mb: int, max_norm_frac: float, norm_type: float):
    """The unsplit model's total norm and clipped gradients (max_norm = frac x the norm)."""
    from .bodies import reference

    model = zoo.get(name).model  # zoo.get builds the same seeded model every time
    _, grads = reference(name, n_mb)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied: both names, one tensor
    for n, g in grads.items():
        params[n].grad = g.clone()
    unique = list(model.parameters())  # tied weights once, as torch counts them
    norm = torch.nn.utils.get_total_norm([p.grad for p in unique], norm_type)
    max_norm = max_norm_frac * float(norm)
    total = torch.nn.utils.clip_grad_norm_(unique, max_norm, norm_type)
    return float(total), max_norm, {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}


def clip_step(rank: int, world: int, name: str, schedule: str, n_mb: int, max_norm: float, norm_type: float):
    from .bodies import _mb_example

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    total = ps.clip_grad_norm_(sched, max_norm, norm_type)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"total": float(total), "grads": grads}


def ac_step(rank: int, world: int, name: str, schedule: str, n_mb: int):
    """One step with activation_checkpoint="full"; also counts each stage module's calls."""
    from .bodies import _mb_example

    entry = zoo.get(name)
    pipe = ps.pipeline(entry.model, entry.split_spec, *_mb_example(entry, n_mb))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn, activation_checkpoint="full")
    calls = {}
    for st in sched.stages:
        calls[st.stage_index] = 0

        def count(module, args, out, s=st.stage_index):
            calls[s] += 1

        st.module.register_forward_hook(count)
    sched.step(*entry.args, target=entry.target, **entry.kwargs)
    grads = {n: p.grad.clone() for st in sched.stages
             for n, p in st.module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return {"loss": float(sched.loss), "grads": grads, "calls": calls}
