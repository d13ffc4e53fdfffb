"""Render: a wide timeline wraps into labelled bands; the SVG has a time axis and a title."""

from __future__ import annotations

import io
import re

from rich.console import Console

from pippy_split.schedule import get_schedule_class, simulate
from pippy_split.schedule.render import render_rich, render_svg


def _sim():
    return simulate(get_schedule_class("ZBVZeroBubble").compute_order(4, 8, 2))


def _text(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_a_wrapped_timeline_labels_every_action_at_80_columns():
    sim = _sim()
    out = _text(render_rich(sim, wrap=True), 80)
    assert all(len(line) <= 80 for line in out.splitlines())
    order = get_schedule_class("ZBVZeroBubble").compute_order(4, 8, 2)
    for rank in range(4):
        rows = " ".join(line.split("|", 1)[1] for line in out.splitlines() if line.startswith(f"rank {rank} |"))
        labels = re.findall(r"\b\d[FIWB]\d\b", rows)
        assert labels == [str(a) for a in order[rank] if a is not None]  # a band never cuts a label


def test_unwrapped_view_still_squeezes_into_one_band():
    out = _text(render_rich(_sim()), 80)
    assert sum(line.startswith("rank 0 |") for line in out.splitlines()) == 1


def test_svg_has_a_time_axis_and_names_the_schedule():
    svg = render_svg(_sim(), title="ZBVZeroBubble: 4 ranks, 8 microbatches")
    assert ">ZBVZeroBubble: 4 ranks, 8 microbatches: 4 ranks, makespan" in svg
    axis = re.search(r'<g class="axis">(.*?)</g>', svg)
    assert axis and ">time</text>" in axis.group(1)
    ticks = re.findall(r'text-anchor="middle">([\d.]+)</text>', axis.group(1))
    assert ticks[0] == "0" and len(ticks) >= 3


def test_a_simulation_draws_its_svg_under_a_title():
    svg = _sim().to_svg(title="ZBVZeroBubble, 4 ranks, 8 microbatches")
    assert ">ZBVZeroBubble, 4 ranks, 8 microbatches: 4 ranks, makespan" in svg
