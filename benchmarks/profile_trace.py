"""A ``torch.profiler`` trace of one pipelined step on 2 gloo ranks, drawn as the schedule's timeline.

Run with ``python -m benchmarks.profile_trace`` (CPU is enough, ~30 s). Each rank runs a
warm-up step, then one step under ``torch.profiler.profile`` and exports its Chrome trace
(``chrome://tracing`` or https://ui.perfetto.dev open it). Every compute action of the step
is a ``record_function`` mark named like ``pippy_split 1I3: stage 1 backward input, mb 3``
and every batch of comm actions one mark ``pippy_split comm 0SEND_F2 0RECV_B0``; this script
reads those marks back from both ranks' traces (one clock on one machine), draws them with
the simulator's SVG renderer, and prints each action kind's measured mean beside the
simulator's makespan for the same order with those costs.

Outputs: ``benchmarks/results/profile_trace_2ranks.svg`` (in docs/profiler.md) and the two Chrome
traces in ``--trace-dir`` (default a temporary directory; not committed: a few MB each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

import pippy_split as ps
from pippy_split import zoo
from pippy_split.schedule import simulate
from pippy_split.schedule.actions import parse_action
from pippy_split.schedule.simulate import Simulation
from pippy_split.testing import run_ranks

RESULTS = Path(__file__).parent / "results"


def profiled_step(rank: int, world: int, schedule: str, n_mb: int, trace_dir: str) -> list[dict]:
    """One rank: a warm step, then a profiled one; its trace's pippy_split marks."""
    torch.manual_seed(0)
    entry = zoo.get("tiny_gpt")
    x, y = entry.args[0], entry.target
    pipe = ps.pipeline(entry.model, world * (2 if schedule in ("ZBVZeroBubble", "Interleaved1F1B") else 1),
                       (x[: x.shape[0] // n_mb],))
    sched = ps.build_schedule(pipe, schedule, n_mb, loss_fn=entry.loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched.step(x, target=y)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sched.step(x, target=y)
    path = Path(trace_dir) / f"trace_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    return [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))} for e in events
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("pippy_split")]


def as_simulation(marks: list[list[dict]]) -> tuple[Simulation, dict[str, list[float]]]:
    """The measured compute actions of every rank as a ``Simulation`` the renderers draw
    (times in seconds from the first mark), and each kind's durations."""
    t0 = min(m["ts"] for rank in marks for m in rank)
    timeline, durations = {}, {}
    busy = 0.0
    for r, rank in enumerate(marks):
        rows = []
        for m in rank:
            label = m["name"].removeprefix("pippy_split ")
            if label.startswith("comm "):
                continue
            action = parse_action(label.split(":")[0])
            start, end = (m["ts"] - t0) / 1e6, (m["ts"] + m["dur"] - t0) / 1e6
            rows.append((start, end, action))
            durations.setdefault(action.kind.name, []).append(end - start)
            busy += end - start
        timeline[r] = sorted(rows, key=lambda e: e[0])
    makespan = max(end for rows in timeline.values() for _, end, _ in rows)
    sim = Simulation(makespan=makespan, bubble_fraction=1.0 - busy / (len(marks) * makespan),
                     peak_activations={r: 0 for r in timeline}, num_ranks=len(marks), _timeline=timeline)
    return sim, durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--trace-dir", default=None)
    args = parser.parse_args()
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="pippy_split_trace_")
    marks = run_ranks(profiled_step, 2, args.schedule, args.microbatches, trace_dir, timeout=300)
    sim, durations = as_simulation(marks)
    RESULTS.mkdir(exist_ok=True)
    svg = RESULTS / "profile_trace_2ranks.svg"
    sim.to_svg(str(svg), title=f"measured: torch.profiler marks, {args.schedule}, 2 gloo ranks, "
                               f"m={args.microbatches}")
    means = {k: statistics.mean(v) for k, v in durations.items()}
    order = ps.get_schedule_class(args.schedule).compute_order(num_ranks=2, n_microbatches=args.microbatches)
    costs = {k: means.get(k, 0.0) for k in ("F", "B", "I", "W") if k in means}
    if "B" in costs and "I" not in costs:
        costs["I"], costs["W"] = costs["B"] / 2, costs["B"] / 2
    simulated = simulate(order, costs=costs)
    print(f"traces: {trace_dir}/trace_rank0.json, trace_rank1.json; picture: {svg}")
    print("kind  n  mean ms")
    for k, v in sorted(durations.items()):
        print(f"{k:>4} {len(v):>2} {1e3 * statistics.mean(v):8.2f}")
    print(f"measured compute makespan {1e3 * sim.makespan:.1f} ms, bubble {sim.bubble_fraction:.2f}; simulated "
          f"with these means {1e3 * simulated.makespan:.1f} ms, bubble {simulated.bubble_fraction:.2f}")


if __name__ == "__main__":
    main()
