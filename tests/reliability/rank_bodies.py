"""Rank bodies of the cross-rank reliability cases (top-level so they pickle)."""

from __future__ import annotations

import torch

import pippy_split as ps
from pippy_split import zoo


def _outcome(fn):
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # returned, not raised: the failing rank stays alive, as in a notebook
        return (type(e).__name__, str(e))


def one_rank_fails_its_checks(rank: int, world: int):
    """kwargs_buffers on 3 ranks (1F1B): rank 0 alone splits the inputs (the ``mask`` kwarg
    travels from there to the last stage); it gets a mask of another batch size. Then a
    schedule without loss_fn (only rank 2, with the last stage, can tell); then a good step."""
    entry = zoo.get("kwargs_buffers")
    mb = ps.split_args_kwargs(entry.args, entry.kwargs, 4)[0]
    pipe = ps.pipeline(entry.model, entry.split_spec, *mb)
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=entry.loss_fn, timeout=600)
    bad = dict(entry.kwargs, mask=entry.kwargs["mask"][:6]) if rank == 0 else entry.kwargs
    out = [_outcome(lambda: sched.step(*entry.args, target=entry.target, **bad))]
    no_loss = ps.build_schedule(pipe, "1F1B", 4, timeout=600)
    out.append(_outcome(lambda: no_loss.step(*entry.args, target=entry.target, **entry.kwargs)))
    out.append(_outcome(lambda: sched.step(*entry.args, target=entry.target, **entry.kwargs)))
    out.append(float(sched.loss))
    return out
