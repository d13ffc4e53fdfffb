"""Pictures of schedules: simulated timelines, one row per rank, as text and ``rich``.

Sits at the end of the schedule layer, above the simulator and the schedule classes,
which import it only when asked for a picture (it imports ``rich``; nothing else in
``schedule/`` does): ``Simulation``'s ``__str__`` and ``__rich__`` call the functions
here. SVG and HTML live in :mod:`.render_web` (no ``rich``) and what both share in
:mod:`.timeline`; both are re-exported here. Nothing here computes or simulates a
schedule; it only draws one. A simulation is read duck-typed: ``timeline`` ``{rank:
[(start, end, Action), ...]}``, ``makespan``, ``num_ranks`` and, when present,
``bubble_fraction`` and ``peak_activations``. The order table (:func:`format_order`,
what a ``ScheduleError`` prints) lives with the IR in :mod:`.actions`, without
``rich``, and is re-exported here.
"""

from __future__ import annotations

from typing import Any, Iterator

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

from .actions import Action, format_order
from .render_web import SVG_MAX_ACTIONS, html_table, render_html, render_schedule_html, render_svg
from .timeline import (
    KIND_COLORS,
    cell_label,
    columns_per_unit,
    kind_key,
    peaks_line,
    ruler_line,
    segments,
    summary_line,
    timeline_spans,
)

__all__ = ["format_order", "render_text", "render_rich", "render_svg", "render_html", "render_schedule_html",
           "html_table", "KIND_COLORS", "SVG_MAX_ACTIONS"]

_RICH_STYLES: dict[str, str] = {
    "F": "bold white on #4c8be8",
    "B": "bold black on #e8804c",
    "I": "bold black on #e8c84c",
    "W": "bold black on #5cb85c",
    "comm": "black on #b0b0b0",
}


# -- plain text ----------------------------------------------------------------


def render_text(sim: Any, width: int | None = None) -> str:
    """The timeline as plain text, one row per rank; ``.`` is idle time.

    Args:
        sim: a ``Simulation`` (see the module docstring for what is read).
        width: squeeze the timeline into this many columns (labels shorten).

    Example:
        >>> from pippy_split.schedule import get_schedule_class, simulate
        >>> sim = simulate(get_schedule_class("1F1B").compute_order(num_ranks=2, n_microbatches=2))
        >>> print(render_text(sim))
        2 ranks, makespan 9, bubble 33.3%
                0       2       4       6       8
        rank 0 |0F0 0F1 ........0B0     ....0B1     |
        rank 1 |....1F0 1B0     1F1 1B1     ........|
        peak activations: r0=2 r1=1
    """
    scale = columns_per_unit(sim, width)
    total = max(1, round(sim.makespan * scale))
    spans = timeline_spans(sim)
    label_w = len(f"rank {max(spans, default=0)}")
    lines = [summary_line(sim), ruler_line(sim.makespan, scale, total, label_w + 2)]
    for r, entries in spans.items():
        row = "".join(cell_label(a, c1 - c0) for c0, c1, a in segments(entries, scale, total))
        lines.append(f"{f'rank {r}'.ljust(label_w)} |{row}|")
    peaks = peaks_line(sim)
    if peaks:
        lines.append(peaks)
    return "\n".join(lines)


# -- rich ------------------------------------------------------------------------


class TimelineView:
    """A rich renderable of a simulation that squeezes itself to the console width."""

    def __init__(self, sim: Any, wrap: bool = False) -> None:
        self.sim = sim
        self.wrap = wrap  # too wide for the console: bands of full labels instead of squeezing

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        natural = round(self.sim.makespan * columns_per_unit(self.sim, None)) + 12
        return Measurement(min(20, natural), natural)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        sim = self.sim
        spans = timeline_spans(sim)
        label_w = len(f"rank {max(spans, default=0)}")
        avail = max(1, options.max_width - label_w - 3)
        scale = columns_per_unit(sim, None if self.wrap else avail)
        total = max(1, round(sim.makespan * scale))
        yield Text(summary_line(sim), style="bold")
        ruler = ruler_line(sim.makespan, scale, total, 0)
        for b0, b1 in _bands(spans, scale, total, avail):  # one band unless wrapping a wide timeline
            yield Text(" " * (label_w + 2) + ruler[b0:b1].rstrip(), style="dim", no_wrap=True, overflow="crop")
            for r, entries in spans.items():
                row = Text(f"{f'rank {r}'.ljust(label_w)} |", no_wrap=True, overflow="crop")
                for c0, c1, a in segments(entries, scale, total):
                    lo, hi = max(c0, b0), min(c1, b1)
                    if lo < hi:
                        style = "dim" if a is None else _RICH_STYLES[kind_key(a)]
                        row.append(cell_label(a, c1 - c0)[lo - c0 : hi - c0], style=style)
                row.append("|")
                yield row
        legend = Text("legend: ")
        for key, style in _RICH_STYLES.items():
            legend.append(f" {key} ", style=style)
            legend.append(" ")
        legend.append(" . idle", style="dim")
        yield legend
        peaks = peaks_line(sim)
        if peaks:
            yield Text(peaks, style="dim")


def _bands(spans: dict[int, list[tuple[float, float, Action]]], scale: float, total: int,
           avail: int) -> Iterator[tuple[int, int]]:
    """Column ranges of at most ``avail`` columns, each ending where no rank's action is
    cut in two (an idle stretch may be), unless no such column is in reach."""
    inside = [False] * (total + 1)  # inside[c]: column c falls strictly inside an action
    for entries in spans.values():
        for c0, c1, a in segments(entries, scale, total):
            if a is not None:
                for c in range(c0 + 1, c1):
                    inside[c] = True
    b0 = 0
    while b0 < total:
        b1 = min(b0 + avail, total)
        if b1 < total:
            clean = next((c for c in range(b1, b0, -1) if not inside[c]), b1)
            b1 = clean
        yield b0, b1
        b0 = b1


def render_rich(sim: Any, wrap: bool = False) -> TimelineView:
    """A rich renderable: one row per rank, coloured by kind (F, B, I, W, comm), idle dim.

    Args:
        sim: a ``Simulation``.
        wrap: where the timeline is wider than the console, show it in bands of
            time, each action labelled (``0F3``), rather than squeezed to one band
            whose labels shorten to the kind letter.

    Example:
        >>> from pippy_split.schedule import get_schedule_class, simulate
        >>> sim = simulate(get_schedule_class("1F1B").compute_order(num_ranks=2, n_microbatches=2))
        >>> Console(width=60, color_system=None).print(render_rich(sim, wrap=True))  # in colour on a terminal
        2 ranks, makespan 9, bubble 33.3%
                0       2       4       6       8
        rank 0 |0F0 0F1 ........0B0     ....0B1     |
        rank 1 |....1F0 1B0     1F1 1B1     ........|
        legend:  F   B   I   W   comm   . idle
        peak activations: r0=2 r1=1
    """
    return TimelineView(sim, wrap=wrap)
