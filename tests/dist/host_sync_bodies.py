"""Rank bodies of the host-sync and collective counts (issue 31): every schedule, the kit on."""

from __future__ import annotations

import collections
import contextlib
import warnings

import torch
import torch.distributed as dist

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule.orders import ORDERS

READS = ["item", "__bool__", "__int__", "__float__", "tolist", "nonzero"]
COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "barrier", "broadcast_object_list", "all_gather_object", "gather", "scatter", "reduce"]


@contextlib.contextmanager
def counting(counts: collections.Counter):
    """Count host reads of tensor values (``Tensor.item`` & co., ``torch.equal``) and collectives."""
    saved = {n: getattr(torch.Tensor, n) for n in READS}
    saved_equal = torch.equal
    saved_coll = {n: getattr(dist, n) for n in COLLECTIVES}

    def wrap(key, fn):
        def counted(*a, **k):
            counts[key] += 1
            return fn(*a, **k)
        return counted

    try:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, wrap(("read", n), fn))
        torch.equal = wrap(("read", "equal"), saved_equal)
        for n, fn in saved_coll.items():
            setattr(dist, n, wrap(("collective", n), fn))
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)
        torch.equal = saved_equal
        for n, fn in saved_coll.items():
            setattr(dist, n, fn)


def steady_state_counts(rank: int, world: int, kit: bool):
    """Per schedule: the host reads and collectives of the third step (and its clip)."""
    entry = zoo.get("tiny_gpt")
    x, y = entry.args[0], entry.target
    pipes = {n: ps.pipeline(entry.model, n, (x[:2],)) for n in (2, 4)}
    out = {}
    for name, spec in ORDERS.items():
        stages = world * (spec.stages_per_rank or spec.min_stages_per_rank)
        options = dict(activation_checkpoint=["blocks.*"], mixed_precision=torch.bfloat16,
                       loss_count=lambda t: (t >= 0).sum()) if kit else {}
        sched = ps.build_schedule(pipes[stages], name, 4, loss_fn=entry.loss_fn if not kit else _sum_loss(entry),
                                  **options)
        counts: collections.Counter = collections.Counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(3):
                with counting(counts) if i == 2 else contextlib.nullcontext():
                    sched.step(x, target=y)
                    if kit:
                        ps.clip_grad_norm_(sched, 1.0)
                for p in entry.model.parameters():
                    p.grad = None
        out[name] = dict(counts)
    return out


def dynamic_shape_counts(rank: int, world: int):
    """1F1B over a pipe traced with a dynamic sequence dim: the third step's reads and collectives,
    its microbatches of different lengths."""
    from torch.export import Dim

    entry = zoo.get("tiny_gpt")
    x, y = entry.args[0], entry.target
    pipe = ps.pipeline(entry.model, 2, (x[:2],), dynamic_shapes={"idx": {1: Dim("T", min=2, max=64)}})
    sched = ps.build_schedule(pipe, "1F1B", 4, loss_fn=entry.loss_fn)
    counts: collections.Counter = collections.Counter()
    steps = ([8, 12, 16, 8], [16, 8, 4, 12], [4, 8, 12, 16])
    batches = [ps.Microbatches(x[2 * i:2 * i + 2, :T] for i, T in enumerate(lengths)) for lengths in steps]
    targets = [ps.Microbatches(y[2 * i:2 * i + 2, :T] for i, T in enumerate(lengths)) for lengths in steps]
    for i, (batch, target) in enumerate(zip(batches, targets)):
        with counting(counts) if i == 2 else contextlib.nullcontext():
            sched.step(batch, target=target)
        for p in entry.model.parameters():
            p.grad = None
    return dict(counts)


def _sum_loss(entry):
    def loss(out, tgt):
        return entry.loss_fn(out, tgt) * tgt.numel()
    return loss
