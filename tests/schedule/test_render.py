"""Rendering: text, rich, SVG and HTML timelines, and the order table."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from pippy_split.schedule.actions import Action, ActionKind, Order, parse_action
from pippy_split.schedule.lower import lower
from pippy_split.schedule.render import (
    KIND_COLORS,
    format_order,
    render_html,
    render_rich,
    render_svg,
    render_text,
)
from pippy_split.schedule.simulate import simulate

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def parse_order(rows: dict[int, str]) -> Order:
    return {r: [None if t == "." else parse_action(t) for t in row.split()] for r, row in rows.items()}


ORDER = parse_order({0: "0F0 0F1 0I0 0W0 0I1 0W1", 1: "1F0 1B0 1F1 1B1", 2: "2F0 2I0 2F1 2I1 2W0 2W1"})


@pytest.fixture
def sim():
    return simulate(ORDER)


def rich_text(renderable, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, color_system="truecolor", force_terminal=True, record=True)
    console.print(renderable)
    return console.export_text()


def test_text_has_one_row_per_rank(sim) -> None:
    text = render_text(sim)
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert [row.split("|")[0].strip() for row in rows] == ["rank 0", "rank 1", "rank 2"]
    assert len({len(row) for row in rows}) == 1  # rows line up
    assert "0F0" in rows[0] and "1B0" in rows[1] and "2W1" in rows[2]
    assert "." in rows[0]  # rank 0 idles while waiting for gradients
    assert f"makespan {sim.makespan:g}" in text and "bubble" in text
    assert str(sim) == text


def test_text_squeezes_to_width(sim) -> None:
    rows = [line for line in render_text(sim, width=20).splitlines() if line.startswith("rank ")]
    assert all(len(row) <= len("rank 0 |") + 20 + 1 for row in rows)


def test_rich_rows_and_colours(sim) -> None:
    out = rich_text(render_rich(sim))
    for r in range(3):
        assert f"rank {r} |" in out
    console = Console(file=io.StringIO(), width=100, color_system="truecolor", force_terminal=True)
    console.print(render_rich(sim))
    ansi = console.file.getvalue()
    # each compute kind gets its own background colour: 4 distinct backgrounds
    backgrounds = set(re.findall(r"48;2;(\d+;\d+;\d+)", ansi))
    assert len(backgrounds) >= 4
    assert rich_text(sim) == out  # Simulation.__rich__


def test_rich_fits_narrow_console(sim) -> None:
    out = rich_text(render_rich(sim), width=30)
    rows = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(rows) == 3 and all(len(row) <= 30 for row in rows)


def test_svg_rows_boxes_and_file(sim, tmp_path: Path) -> None:
    path = tmp_path / "t.svg"
    svg = render_svg(sim, path)
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert path.read_text() == svg
    for r in range(3):
        assert f">rank {r}</text>" in svg
    for kind in ("F", "B", "I", "W"):
        assert KIND_COLORS[kind] in svg
    assert ">0F0</text>" in svg and "rank 2: 2W1" in svg
    assert svg.count('class="action') == sum(len([a for a in acts if a]) for acts in ORDER.values())
    assert sim.to_svg() == svg


def test_svg_of_lowered_order_skips_zero_length_comm() -> None:
    sim = simulate(lower(ORDER))
    svg = render_svg(sim)
    assert "SEND" not in svg and "RECV" not in svg  # comm costs 0 time: nothing to draw
    assert "rank 2" in render_text(sim)


def test_html_embeds_svg(sim) -> None:
    page = render_html(sim)
    assert "<svg" in page and "rank 1" in page
    assert sim._repr_html_() == page


def test_format_order_marks_and_idle() -> None:
    table = format_order(ORDER | {3: [None, Action(3, F, 0)]}, mark=(1, 2))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["step", "0", "1"]
    assert [line.split()[1] for line in lines[1:]] == ["0", "1", "2", "3"]
    assert "[1F1]" in lines[2] and lines[4].split()[2] == "."
    several = format_order(ORDER, mark={0: 0, 2: 5})
    assert "[0F0]" in several and "[2W1]" in several


def test_format_order_window_and_end_marker() -> None:
    long = {0: [Action(0, F, mb) for mb in range(100)]}
    table = format_order(long, mark=(0, 50))
    assert "[0F50]" in table and "0F10" not in table and table.count("…") == 2
    assert "0F99" in format_order(long, max_steps=None)
    assert "[<end>]" in format_order({0: [Action(0, F, 0)], 1: []}, mark=(1, 0))
