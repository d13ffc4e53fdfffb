"""Time to split a model: ``ps.pipeline`` vs ``torch.distributed.pipelining.pipeline``.

Run with ``python -m benchmarks.split_time`` (CPU is enough). For a stack of 8, 32
and 64 pre-norm residual MLP blocks (d=256) cut into 4 stages it times, median of
several runs each:

    export  ``torch.export.export`` alone (the floor the peer pays)
    export as ours  the same without a stack trace per node, as ``ps.pipeline`` runs it
    ours    ``pippy_split.pipeline`` (export + partition + stage modules + edges)
    peer    ``torch.distributed.pipelining.pipeline`` with a SplitPoint.BEGINNING spec

and prints a table with ours/peer and (ours - export) as a percentage of export.
Because that difference of two wall-clock medians is at the mercy of other load
on the machine, it also gives the same difference in CPU time of this process, and
times our post-export work (partition + stage modules) directly.
Results go to ``benchmarks/results/split_time.json``. The peer is imported here
only; the library never imports it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import pippy_split as ps
from pippy_split.split.kept_calls import no_stack_traces
from pippy_split.split.partition import plan_stages
from pippy_split.split.stage_graph import build_stages
from pippy_split.split.trace import trace_model

D = 256
NUM_STAGES = 4
RESULTS = Path(__file__).parent / "results" / "split_time.json"


class Block(nn.Module):
    """Pre-norm residual MLP: x + fc2(gelu(fc1(norm(x)))), (B, d) -> (B, d)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """``n_blocks`` Blocks ``blocks.{i}`` followed by a final norm."""

    def __init__(self, n_blocks: int, d: int = D) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # (B, d)
        return self.norm(x)


def _fresh(n_blocks: int) -> nn.Module:
    # A fresh model per run, built outside the timed region: the peer patches the
    # model's forward methods (split markers), so it cannot split one model twice.
    torch.manual_seed(0)
    return Stack(n_blocks)


def _time(fn: Callable[[nn.Module], object], n_blocks: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call on a fresh model."""
    model = _fresh(n_blocks)
    gc.collect()  # garbage left by the previous run is not this run's cost
    t0, c0 = time.perf_counter(), time.process_time()
    fn(model)
    return time.perf_counter() - t0, time.process_time() - c0


def measure(n_blocks: int) -> dict:
    """Median times of export / ours / peer, interleaved run by run so that load from
    other processes hits all three alike; 5 runs when one round is quick (< 6 s), else 3."""
    x = torch.randn(8, D)  # (B, d), one microbatch
    split_fqns = [f"blocks.{s * n_blocks // NUM_STAGES}" for s in range(1, NUM_STAGES)]

    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining import pipeline as peer_pipeline

    def export_only(model):
        return torch.export.export(model, (x,), strict=False)

    def export_as_ours(model):
        with no_stack_traces():
            return torch.export.export(model, (x,), strict=False)

    def ours(model):
        pipe = ps.pipeline(model, split_fqns, (x,))
        assert pipe.num_stages == NUM_STAGES
        return pipe

    def ours_after_export(model):
        # The same steps as ps.pipeline, timing only what follows the trace.
        traced = trace_model(model, (x,))
        t0 = time.perf_counter()
        build_stages(traced, plan_stages(traced.graph, split_fqns, model), model)
        return time.perf_counter() - t0

    def peer(model):
        with warnings.catch_warnings():  # the peer's own deprecation noise (pytree LeafSpec)
            warnings.simplefilter("ignore", FutureWarning)
            pipe = peer_pipeline(model, mb_args=(x,), split_spec={f: SplitPoint.BEGINNING for f in split_fqns})
        assert pipe.num_stages == NUM_STAGES
        return pipe

    fns = {"export_s": export_only, "export_as_ours_s": export_as_ours, "ours_s": ours, "peer_s": peer}
    t0 = time.perf_counter()
    for fn in fns.values():  # warm-up round
        fn(_fresh(n_blocks))
    runs = 5 if time.perf_counter() - t0 < 6.0 else 3
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    split_only = []
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(_time(fn, n_blocks))
        split_only.append(ours_after_export(_fresh(n_blocks)))
    row: dict = {"blocks": n_blocks, "runs": runs}
    row.update({k: statistics.median(w for w, _ in v) for k, v in times.items()})
    row.update({k.replace("_s", "_cpu_s"): statistics.median(c for _, c in v) for k, v in times.items()})
    row["ours_minus_export_cpu_pct"] = 100.0 * (row["ours_cpu_s"] - row["export_cpu_s"]) / row["export_cpu_s"]
    row["ours_after_export_s"] = statistics.median(split_only)
    row["ours_over_peer"] = row["ours_s"] / row["peer_s"]
    row["ours_minus_export_pct"] = 100.0 * (row["ours_s"] - row["export_s"]) / row["export_s"]
    row["after_export_pct"] = 100.0 * row["ours_after_export_s"] / row["export_s"]
    # what share of ours is export (as ours runs it), and what is our own work after it
    row["export_share_of_ours_pct"] = 100.0 * row["export_as_ours_s"] / row["ours_s"]
    row["own_work_share_of_ours_pct"] = 100.0 * row["ours_after_export_s"] / row["ours_s"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    rows = [measure(n) for n in args.blocks]
    table = Table(title=f"split time, d={D}, {NUM_STAGES} stages (median seconds)")
    cols = ("blocks", "export s", "export as ours s", "ours s", "peer s", "ours/peer", "ours-export, % of export",
            "same, CPU time", "split after export s (% of export)")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["blocks"]), f"{r['export_s']:.3f}", f"{r['export_as_ours_s']:.3f}", f"{r['ours_s']:.3f}", f"{r['peer_s']:.3f}",
                      f"{r['ours_over_peer']:.2f}", f"{r['ours_minus_export_pct']:.1f}%",
                      f"{r['ours_minus_export_cpu_pct']:.1f}%",
                      f"{r['ours_after_export_s']:.3f} ({r['after_export_pct']:.1f}%)")
    Console(width=160).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
            "d": D, "num_stages": NUM_STAGES}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
