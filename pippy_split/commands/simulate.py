"""``pippy-split simulate``: a schedule's timeline, bubble and activation memory, or all schedules side by side.

Where this sits: on the schedule layer only (orders, the simulator, pictures); no model,
no tensors. :mod:`pippy_split.cli` parses the command line and hands over here.

Example:
    >>> parse_costs("F=1, I=2,W=1")
    {'F': 1.0, 'I': 2.0, 'W': 1.0}
"""

from __future__ import annotations

import argparse
from typing import Any

from rich import box
from rich.table import Table

from ..schedule import get_schedule_class, simulate
from ..schedule.orders import ORDERS
from ..schedule.render import render_rich, render_svg

__all__ = ["parse_costs", "simulate_cmd"]


def parse_costs(text: str | None) -> dict[str, float] | None:
    """``"F=1,I=1,W=1"`` -> ``{"F": 1.0, "I": 1.0, "W": 1.0}`` (keys among F, B, I, W)."""
    if not text:
        return None
    costs: dict[str, float] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().upper()
        if not sep or key not in ("F", "B", "I", "W"):
            raise ValueError(f"bad cost {part!r}: expected KIND=NUMBER with KIND among F, B, I, W")
        costs[key] = float(value)
    return costs


def _simulate_one(name: str, ranks: int, microbatches: int, spr: int | None, costs: dict | None):
    cls = get_schedule_class(name)
    return simulate(cls.compute_order(ranks, microbatches, spr), costs)


def _compare_spr(spec: Any, requested: int | None) -> int:
    """Stages per rank a --compare row uses: the requested count where the family takes
    it, else the family's fixed count, else at least 2 (as tutorial 03 compares them:
    a looped family run with one stage per rank is just GPipe or 1F1B)."""
    if requested is not None and (spec.stages_per_rank is None or requested == spec.stages_per_rank) \
            and requested >= spec.min_stages_per_rank:
        return requested
    return spec.stages_per_rank or max(spec.min_stages_per_rank, 2)


def _per_stage(costs: dict | None, spr: int) -> dict[str, float]:
    """The same model cut into ``spr`` stages per rank: each action does 1/spr of the work."""
    base = {"F": 1.0, "I": 1.0, "W": 1.0, **(costs or {})}
    return {k: v / spr for k, v in base.items()}


def simulate_cmd(args: argparse.Namespace, console: Any) -> int:
    costs = parse_costs(args.costs)
    if args.schedule not in ORDERS:
        console.print(f"[red]unknown schedule {args.schedule!r}[/]; choose from {', '.join(ORDERS)}")
        return 2
    spr, top_costs, note = args.stages_per_rank, costs, ""
    if args.compare:  # the run shown on top is its row of the table below
        spr = _compare_spr(ORDERS[args.schedule], args.stages_per_rank)
        top_costs = _per_stage(costs, spr)
        note = f", {spr} stages/rank, costs / {spr}" if spr > 1 else ""
    try:
        sim = _simulate_one(args.schedule, args.ranks, args.microbatches, spr, top_costs)
    except (ValueError, TypeError) as e:
        console.print(f"[red]{args.schedule} rejects ranks={args.ranks}, microbatches={args.microbatches}"
                      f"{'' if spr is None else f', stages-per-rank={spr}'}:[/] {e}")
        return 2
    title = f"{args.schedule}: {args.ranks} ranks, {args.microbatches} microbatches"
    console.print(f"[bold]{title}[/]{note}")
    console.print(render_rich(sim, wrap=True))  # bands of labelled actions, not squeezed letters
    console.print(f"makespan {sim.makespan:g}   bubble fraction {sim.bubble_fraction:.1%}")
    console.print("peak activations per rank: "
                  + ", ".join(f"rank {r}: {n}" for r, n in sorted(sim.peak_activations.items())))
    if args.svg:
        render_svg(sim, args.svg, title=title)
        console.print(f"SVG timeline written to {args.svg}")
    if args.compare:
        table = Table(title=f"All schedules, {args.ranks} ranks, {args.microbatches} microbatches",
                      caption="st/rank: stages per rank; costs / st/rank, so every row is the same model; "
                              "peak act: microbatches held, per rank",
                      box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), pad_edge=False)
        for col in ("schedule", "place", "st/rank", "I/W", "makespan", "bubble", "peak act"):
            table.add_column(col, justify="left" if col in ("schedule", "place", "peak act") else "right", no_wrap=True)
        for name, spec in ORDERS.items():
            row_spr = _compare_spr(spec, args.stages_per_rank)
            split = "yes" if spec.split_backward else "no"
            try:
                s = _simulate_one(name, args.ranks, args.microbatches, row_spr, _per_stage(costs, row_spr))
            except (ValueError, TypeError) as e:
                table.add_row(name, spec.placement, str(row_spr), split, "-", "-", f"[yellow]skipped: {e}[/]")
                continue
            peaks = [s.peak_activations[r] for r in sorted(s.peak_activations)]
            table.add_row(name, spec.placement, str(row_spr), split, f"{s.makespan:g}", f"{s.bubble_fraction:.1%}",
                          " ".join(map(str, peaks)))
        console.print(table)
    return 0
