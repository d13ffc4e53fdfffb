"""How long planning takes at scale (issue 12): simulate() of a big order, and a whole search.

Run: ``python -m benchmarks.plan_scale``. On one process (no group):

1. ``simulate()`` of 1F1B on 1024 ranks x 2048 microbatches (compute-only order, per-kind
   costs), and how long generating that order takes.
2. ``ps.plan`` of a tiny GPT (d=128, 32 blocks, global batch 192, example microbatch 8)
   for 8 ranks, every schedule family, checkpointing off and on: the wide search
   (:data:`WIDE`: 4 split metrics x 1-4 stages per rank x every m in 8..192) with ``measure=False`` (op sums), and the
   default search (time-balanced, 1-2 stages per rank) without and with measuring each
   split's stages; candidates simulated and wall-clock seconds of each.

Results: ``benchmarks/results/plan_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import simulate
from pippy_split.schedule.orders import get_order_spec

RESULTS = Path(__file__).parent / "results"


def _simulate_big() -> dict:
    t0 = time.perf_counter()
    order = get_order_spec("1F1B").compute_order(1024, 2048)
    t1 = time.perf_counter()
    sim = simulate(order, {"F": 1.0, "I": 1.0, "W": 1.0})
    t2 = time.perf_counter()
    return {"order_s": t1 - t0, "simulate_s": t2 - t1, "makespan": sim.makespan}


GLOBAL_BATCH = 192
WIDE = {"balance": ("time", "flops", "params", "memory"), "stages_per_rank": (1, 2, 3, 4),
        "microbatches": tuple(m for m in range(8, GLOBAL_BATCH + 1) if GLOBAL_BATCH % m == 0)}
"""The wide search: every split metric, up to 4 stages per rank (32 stages of 32 blocks),
every m from 8 dividing the batch."""


def _plan(measure: bool, wide: bool) -> dict:
    entry = zoo.get("tiny_gpt", d_model=128, n_layer=32, n_head=4, block_size=64, seq_len=64,
                    batch_size=GLOBAL_BATCH)
    mb = entry.args[0][:8]
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ps.plan(entry.model, (mb,), num_ranks=8, memory_budget="8GB", loss_fn=entry.loss_fn,
                       example_target=entry.target[:8], global_batch=GLOBAL_BATCH, measure=measure, **(WIDE if wide else {}))
    return {"measure": measure, "search": "wide" if wide else "default", "seconds": time.perf_counter() - t0,
            "candidates": len(plan.candidates), "best": str(plan.best), "resolution": plan.resolution}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "plan_scale.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    result = {"command": "python -m benchmarks.plan_scale", "load_before": load, "cpus": os.cpu_count(),
              "simulate_1f1b_p1024_m2048": _simulate_big(), "plan_p8": [_plan(False, True), _plan(False, False), _plan(True, False)]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
