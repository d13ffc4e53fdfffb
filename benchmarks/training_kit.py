"""What the training kit costs and saves: activation checkpointing, bf16, compile (issue 11).

Run: ``python -m benchmarks.training_kit [--reps N]``. Tiny GPT d=256, 8 blocks, batch 32,
seq 128, 8 microbatches, 2 gloo ranks (one thread each), 1F1B on 2 stages and
ZBVZeroBubble on 4. In the same rank processes, the schedule without and with
``activation_checkpoint="full"``, with selective ``activation_checkpoint=["blocks.*.mlp"]``, with ``mixed_precision=torch.bfloat16`` and with
``compile=True`` (compiled during the warm-up step) take turns step by step; per step
and rank:

    activation peak   the most bytes autograd holds for backward at once during the step
                      (distinct storages saved through ``saved_tensors_hooks``, parameters
                      left out), counted while they live: what checkpointing trades for
                      recompute (RSS cannot show it: the allocator keeps freed pages); a
                      selective region's recomputed tensors bypass outer hooks, so they are
                      counted from the region's own cache, alive until its graph goes
    step time         wall clock, fenced by a barrier (the same on both ranks)

Figures are medians of per-step values; the ratio is checkpointed / plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from pippy_split.plan.saved_bytes import SavedBytes
from pippy_split.testing import run_ranks

from . import common


class _SavedBytes(SavedBytes):
    """The library's counter, plus selective regions' recomputed tensors (which bypass outer hooks)."""

    def counting_regions(self) -> "_CountedRecompute":
        return _CountedRecompute(self)


class _CountedRecompute:
    """While active, a selective region's recompute registers what it keeps with the counter."""

    def __init__(self, counter: _SavedBytes) -> None:
        from pippy_split.stage import recompute

        self.counter, self.cls = counter, recompute._RegionCall
        self.original = self.cls.recompute

    def __enter__(self) -> None:
        original, counter = self.original, self.counter

        def recompute(call) -> None:
            original(call)
            call.held = [counter.pack(t) for t in call.saved]  # freed with the call, i.e. with its graph

        self.cls.recompute = recompute

    def __exit__(self, *exc: object) -> None:
        self.cls.recompute = self.original


def _build(schedule: str, num_stages: int, **options: object) -> common.Runner:
    """``ps.pipeline`` + ``ps.build_schedule`` with the training-kit options."""
    import pippy_split as ps

    entry = common.gpt(256, num_stages=num_stages)
    pipe = ps.pipeline(entry.model, entry.split_spec, *common.mb_example(entry, 8))
    sched = ps.build_schedule(pipe, schedule, 8, loss_fn=entry.loss_fn, **options)
    return common.Runner(lambda: sched.step(*entry.args, target=entry.target, **entry.kwargs), list(sched.stages))


def _body(rank: int, world: int, schedule: str, num_stages: int, reps: int) -> dict:
    options = {"plain": {}, "full": {"activation_checkpoint": "full"},
               "selective": {"activation_checkpoint": ["blocks.*.mlp"]}, "bf16": {"mixed_precision": torch.bfloat16},
               "compiled": {"compile": True}}
    runners = {v: _build(schedule, num_stages, **options[v]) for v in VARIANTS}
    out: dict[str, dict[str, list[float]]] = {ac: {"peak_mb": [], "s": []} for ac in runners}
    for r in runners.values():
        r.step()  # warm-up
    for _ in range(reps):
        for ac, r in runners.items():  # timed without the counting hooks
            dist.barrier()
            t = time.perf_counter()
            r.step()
            dist.barrier()
            out[ac]["s"].append(time.perf_counter() - t)
        for ac, r in runners.items():
            params = {p.untyped_storage().data_ptr() for st in r.stages for p in st.module.parameters()}
            counter = _SavedBytes(params)
            with counter.hooks(), counter.counting_regions():
                r.step()
            out[ac]["peak_mb"].append(counter.peak / 2**20)
    return out


VARIANTS = ("plain", "full", "selective", "bf16", "compiled")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    for schedule, stages in (("1F1B", 2), ("ZBVZeroBubble", 4)):
        ranks = run_ranks(_body, 2, schedule, stages, args.reps, timeout=900)
        t = {v: statistics.median(ranks[0][v]["s"]) for v in VARIANTS}
        for rank, res in enumerate(ranks):
            peak = {v: statistics.median(res[v]["peak_mb"]) for v in VARIANTS}
            print(f"{schedule:14s} rank {rank}: activation peak plain {peak['plain']:.1f} MiB, "
                  f"full AC {peak['full']:.1f} MiB -> {peak['full'] / peak['plain']:.2f}x, "
                  f"selective (blocks.*.mlp) {peak['selective']:.1f} MiB -> {peak['selective'] / peak['plain']:.2f}x")
        print(f"{schedule:14s} step time plain {t['plain']:.2f} s, full AC {t['full']:.2f} s -> "
              f"{t['full'] / t['plain']:.2f}x, selective {t['selective'] / t['plain']:.2f}x, bf16 {t['bf16']:.2f} s -> {t['bf16'] / t['plain']:.2f}x, "
              f"compiled {t['compiled']:.2f} s -> {t['compiled'] / t['plain']:.2f}x")


if __name__ == "__main__":
    main()
