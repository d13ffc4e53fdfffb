"""Ours against torch.distributed.pipelining, every item of the benchmark issue in one table.

    python -m benchmarks.compare                 # full run (< 15 min on 2 idle cores)
    python -m benchmarks.compare --quick         # fewer cases, same sizes (~3 min idle)
    python -m benchmarks.compare --only traffic  # one item: split, step, traffic, memory
    python -m benchmarks.compare --smoke --only traffic   # one small case (the smoke test)
    python -m benchmarks.compare --render benchmarks/results/compare.json   # table of a saved run
    python -m benchmarks.compare --readme        # full run, and its table (commit, date) into docs/performance.md

Items (numbers as in the issue):
    split    1  split time, ``ps.pipeline`` vs the peer's ``pipeline`` (benchmarks.split_time)
    step     2  step time, 2 gloo ranks, tiny GPT d=256: ours / peer
             3  runtime overhead at d=32, 32 microbatches: ours / peer
             4  pipeline efficiency: 2-rank 1F1B against one process on one thread
    traffic  5  bytes and messages per step per rank against the analytical minimum
             7  gradient bytes for edges that need no gradient
    memory   6  peak RSS per rank and peak activations held

Every figure is a ratio measured in one run: the median of >= 5 repetitions after a
warm-up, with min and max in brackets. Results go to benchmarks/results/compare.json
(``--out`` to write elsewhere), the table as markdown beside it (compare.md). The
machine's load average is recorded with them: on a shared machine the wall-clock
ratios are only as good as the load was even; the CPU-seconds rows barely move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import memory, step_time, traffic
from .common import git_state, median_range

__all__ = ["ITEMS", "run", "main"]

RESULTS = Path(__file__).parent / "results" / "compare.json"


def _split(mode: str, reps: int) -> dict:
    from . import split_time  # owned by its own module; called through its measure()

    blocks = [8, 32, 64] if mode == "full" else [8]
    return {"rows": [split_time.measure(n) for n in blocks]}


ITEMS: dict[str, Callable[[str, int], dict]] = {
    "split": _split,
    "step": step_time.run,
    "traffic": traffic.run,
    "memory": memory.run,
}
"""Item name -> ``fn(mode, reps) -> results``; ``--only`` picks from these names."""


def run(only: list[str] | None = None, mode: str = "full", reps: int = 5) -> dict:
    """Run the chosen items (all by default); returns the JSON-ready results."""
    names = only or list(ITEMS)
    unknown = [n for n in names if n not in ITEMS]
    if unknown:
        raise SystemExit(f"unknown item(s) {unknown}; choose from {list(ITEMS)}")
    commit, dirty = git_state(REPO)  # before the run writes its own results files
    out: dict[str, Any] = {"meta": {
        "commit": commit, "dirty": dirty,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "mode": mode, "reps": reps, "load_avg_before": os.getloadavg(),
        "command": "python -m benchmarks.compare" + ("" if mode == "full" else f" --{mode}")
                   + (f" --only {','.join(only)}" if only else "")}}
    for name in names:
        t0 = time.perf_counter()
        out[name] = ITEMS[name](mode, reps)
        out[name]["seconds"] = time.perf_counter() - t0
    out["meta"]["load_avg_after"] = os.getloadavg()
    return out


# ---- the table --------------------------------------------------------------------

COLUMNS = ("#", "case", "ours", "peer", "ours/peer or result", "target", "met")
Row = tuple  # one str per column; None in a row list starts a new section


def _met(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "no")


def rows(res: dict) -> list[Row | None]:
    """The table's rows, for the items present in ``res``; None separates items."""
    out: list[Row | None] = []
    for name, fn in (("split", _split_rows), ("step", _step_rows), ("traffic", _traffic_rows),
                     ("memory", _memory_rows)):
        if name in res:
            fn(out, res[name])
            out.append(None)
    return out[:-1]


def rich_table(table_rows: list[Row | None]) -> Table:
    t = Table(title=Text("pippy_split vs torch.distributed.pipelining (median [min, max] of repetitions)"))
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "case" else "right")
    style = {"yes": "green", "no": "red"}
    for row in table_rows:
        if row is None:
            t.add_section()
        else:
            t.add_row(*[Text(cell, style=style.get(cell, "") if i == len(COLUMNS) - 1 else "")
                        for i, cell in enumerate(row)])
    return t


def markdown(table_rows: list[Row | None]) -> str:
    """The same table in GitHub markdown (for docs/performance.md)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in table_rows:
        if row is not None:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines) + "\n"


def _split_rows(out: list, res: dict) -> None:
    for row in res["rows"]:
        n = row["blocks"]
        ratio = row["ours_over_peer"]
        out.append(("1", f"split time, {n} blocks d=256 ({row.get('runs', '?')} runs, medians)",
                    f"{row['ours_s']:.2f} s", f"{row['peer_s']:.2f} s", f"{ratio:.2f}x (of ours: export {row.get('export_share_of_ours_pct', float('nan')):.0f}%, "
                    f"own work after it {row.get('own_work_share_of_ours_pct', float('nan')):.0f}%)",
                    "≤ 0.6x", _met(ratio <= 0.6)))


def _step_rows(out: list, res: dict) -> None:
    for row in res["rows"]:
        c = row["config"]
        item = "2" if c["item"] == "step" else "3"
        case = f"{c['item']} time {c['schedule']}, {c['num_stages']} stages, d={c['d']}, m={c['n_mb']}"
        out.append((item, case, median_range(row["ours_s"]) + " s", median_range(row["peer_s"]) + " s",
                    median_range(row["ours_over_peer"]) + "x", f"≤ {c['target']}x", _met(row["met"])))
        out.append((item, f"  CPU s per step, both ranks ({c['schedule']}, d={c['d']})",
                    median_range(row["ours_cpu_s"]) + " s", median_range(row["peer_cpu_s"]) + " s",
                    median_range(row["cpu_ours_over_peer"]) + "x", "", "—"))
    for row in res["rows"]:
        if "serial_s" in row:
            c = row["config"]
            of_ideal = row["speedup_ours"]["median"] / row["ideal_speedup"]
            out.append(("4", f"efficiency {c['schedule']} m={c['n_mb']}: serial step {row['serial_s']['median']:.2f} s"
                             f" / pipelined step (simulated ideal {row['ideal_speedup']:.2f}x)",
                        median_range(row["speedup_ours"]) + "x", median_range(row["speedup_peer"]) + "x",
                        f"{of_ideal:.1%} of the ideal", "≥ 97% of ideal", _met(of_ideal >= 0.97)))
            if "wall_over_replay" in row:  # where the gap is: between actions, or in them
                out.append(("4", f"  {c['schedule']}: step / its own action times replayed (runtime's cost between "
                                 "actions); summed action times / serial step (actions slower than alone)",
                            median_range(row["wall_over_replay"]) + "x", "",
                            median_range(row["busy_over_serial"]) + "x", "", "—"))


def _bytes(ranks: list[dict]) -> str:
    return " / ".join(f"{int(r['sent_bytes']['median'])} B {int(r['sent_msgs']['median'])} msg" for r in ranks)


def _traffic_rows(out: list, res: dict) -> None:
    for row in res["rows"]:
        c = row["case"]
        exp = " / ".join(f"{e['sent_bytes']} B {e['sent_msgs']} msg" for e in row["expected"])
        peer = _bytes(row["peer"]) if row.get("peer") else f"cannot run: {row.get('peer_error', '')}"
        out.append(("5", f"sent per step, rank 0 / 1 / ...: {c['name']}, {c['schedule']}, {c['world']} ranks, "
                         f"m={c['n_mb']}", _bytes(row["ours"]), peer, f"minimum {exp}", "= minimum",
                    _met(row["ours_equals_minimum"])))
        if "grad" in row:
            g = row["grad"]
            peer_g = f"{int(g['peer_nograd_edge_bytes'])} B" if "peer_nograd_edge_bytes" in g else "cannot run"
            out.append(("7", f"gradient bytes on no-grad edges: {c['name']} (needed gradients "
                             f"{g['needed_bytes']} B/step; the no-grad edges carry {int(row['nograd_edge_bytes'])}"
                             " B/step forward)",
                        f"{int(g['ours_nograd_edge_bytes'])} B", peer_g,
                        f"backward {int(g['ours_bytes'])} B vs peer "
                        + (f"{int(g['peer_bytes'])} B" if "peer_bytes" in g else "—"),
                        "0 B", _met(g["ours_nograd_edge_bytes"] == 0)))


def _memory_rows(out: list, res: dict) -> None:
    for row in res["rows"]:
        for r, x in enumerate(row["ranks"]):
            o, p = x["ours"], x["peer"]
            out.append(("6", f"peak RSS of a step, {row['schedule']} d={row['d']} m={row['n_mb']}, rank {r} "
                             f"(above the rank's start: {o['step_peak_above_start_mb']['median']:.0f} vs "
                             f"{p['step_peak_above_start_mb']['median']:.0f} MB)",
                        median_range(o["step_peak_mb"], "{:.0f}") + " MB", median_range(p["step_peak_mb"], "{:.0f}") + " MB",
                        f"{x['ours_over_peer']:.2f}x (above start {x['above_start_ours_over_peer']:.2f}x)",
                        "≤ 0.8x", _met(x["ours_over_peer"] <= memory.TARGET)))
            if "ours_meta" in x:
                m = x["ours_meta"]
                out.append(("6", f"  same, ours with the model built on meta (rank allocates its stage only), "
                                 f"rank {r}", median_range(m["step_peak_mb"], "{:.0f}") + " MB",
                            median_range(p["step_peak_mb"], "{:.0f}") + " MB", f"{x['meta_over_peer']:.2f}x", "≤ 0.8x",
                            _met(x["meta_over_peer"] <= memory.TARGET)))
            out.append(("6", f"peak activations held, {row['schedule']}, rank {r} (microbatches)",
                        f"{o['held']['median']:.0f}", f"{p['held']['median']:.0f}", "", "", "—"))


REPO = Path(__file__).resolve().parent.parent
PERFORMANCE_DOC = REPO / "docs" / "performance.md"
BEGIN, END = "<!-- benchmarks.compare table: begin -->", "<!-- benchmarks.compare table: end -->"


def write_readme_table(readme: Path, table: str, meta: dict) -> None:
    """Replace the table between the markers of ``readme`` (docs/performance.md by default) with
    ``table``, stamped with the commit
    the run measured (taken when it started) and the date."""
    import datetime

    commit, dirty = (meta["commit"], meta["dirty"]) if "commit" in meta else git_state(readme.parent)
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers to write the table between")
    stamp = (f"Measured at commit `{commit}`{' (with uncommitted changes)' if dirty else ''} on "
             f"{datetime.date.today().isoformat()}, torch {meta['torch']}, {meta['cpus']} CPUs, load average "
             f"{meta['load_avg_before'][0]:.1f} before / {meta['load_avg_after'][0]:.1f} after, with "
             f"`{meta['command']} --readme`.")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{stamp}\n\n{table.rstrip()}\n{END}{tail}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_true", help="fewer cases, same sizes")
    modes.add_argument("--smoke", action="store_true", help="one small case per item (for the tests)")
    parser.add_argument("--only", default=None, help=f"comma-separated items from {list(ITEMS)}")
    parser.add_argument("--reps", type=int, default=5, help="repetitions after warm-up (>= 5 for the record)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", type=Path, default=None, help="print the table of a saved JSON; run nothing")
    parser.add_argument("--readme", type=Path, nargs="?", const=PERFORMANCE_DOC, default=None,
                        help="also write the table, the commit and the date into docs/performance.md")
    args = parser.parse_args(argv)
    if args.render is not None:
        res = json.loads(args.render.read_text())
        Console(width=200).print(rich_table(rows(res)))
        return res
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    res = run(only, "smoke" if args.smoke else "quick" if args.quick else "full", args.reps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    table_rows = rows(res)
    args.out.with_suffix(".md").write_text(markdown(table_rows))
    if args.readme is not None:
        write_readme_table(args.readme, markdown(table_rows), res["meta"])
    Console(width=200).print(rich_table(table_rows))
    m = res["meta"]
    print(f"command: {m['command']}   load average before/after: {m['load_avg_before'][0]:.1f} / "
          f"{m['load_avg_after'][0]:.1f} on {m['cpus']} CPUs   results: {args.out}")
    return res


if __name__ == "__main__":
    main()
