"""Pictures of schedules: simulated timelines, one row per rank (text, rich, SVG, HTML).

Sits at the end of the schedule layer, above the simulator and the schedule classes,
which import it only when asked for a picture (it imports ``rich``; nothing else in
``schedule/`` does): ``Simulation``'s ``__str__``, ``__rich__``, ``to_svg`` and
``_repr_html_`` call the functions here, as does a schedule object's ``_repr_html_``
(a table and its timeline). Nothing here computes or simulates a schedule; it only
draws one. A simulation is read duck-typed: ``timeline`` ``{rank: [(start, end,
Action), ...]}``, ``makespan``, ``num_ranks`` and, when present, ``bubble_fraction``
and ``peak_activations``. The order table (:func:`format_order`, what a
``ScheduleError`` prints) lives with the IR in :mod:`.actions`, without ``rich``, and
is re-exported here.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text

from .actions import Action, format_order

__all__ = ["format_order", "render_text", "render_rich", "render_svg", "render_html", "render_schedule_html",
           "html_table", "KIND_COLORS"]

KIND_COLORS: dict[str, str] = {
    "F": "#4c8be8",  # forward: blue
    "B": "#e8804c",  # full backward: orange
    "I": "#e8c84c",  # input-grad backward: yellow
    "W": "#5cb85c",  # weight-grad backward: green
    "comm": "#b0b0b0",  # SEND/RECV: grey
}
"""Fill colour per action kind, shared by the SVG and the rich renderings."""

_RICH_STYLES: dict[str, str] = {
    "F": "bold white on #4c8be8",
    "B": "bold black on #e8804c",
    "I": "bold black on #e8c84c",
    "W": "bold black on #5cb85c",
    "comm": "black on #b0b0b0",
}
_IDLE = "."
Segment = tuple[int, int, "Action | None"]  # (first column, end column, action or idle)


def _kind_key(action: Action) -> str:
    return action.kind.value if action.kind.is_compute else "comm"


# -- timelines: shared quantisation -------------------------------------------


def _spans(sim: Any) -> dict[int, list[tuple[float, float, Action]]]:
    """Timeline entries with a positive duration, per rank, every rank present."""
    ranks = range(int(getattr(sim, "num_ranks", 0) or 0)) or sorted(sim.timeline)
    out: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in ranks}
    for r, entries in sim.timeline.items():
        out.setdefault(r, []).extend(sorted((e for e in entries if e[1] > e[0]), key=lambda e: e[0]))
    return out


def _scale(sim: Any, width: int | None) -> float:
    """Columns per unit of time: the shortest action gets room for its label."""
    spans = [e for entries in _spans(sim).values() for e in entries]
    if not spans or sim.makespan <= 0:
        return 1.0
    shortest = min(end - start for start, end, _ in spans)
    label = max(len(str(a)) for _, _, a in spans) + 1
    scale = label / shortest
    if width is not None and sim.makespan * scale > width:
        scale = max(width, 1) / sim.makespan
    return scale


def _segments(entries: list[tuple[float, float, Action]], scale: float, total: int) -> Iterator[Segment]:
    """Cover columns ``[0, total)`` with action and idle segments."""
    col = 0
    for start, end, action in entries:
        c0, c1 = max(round(start * scale), col), min(max(round(end * scale), round(start * scale) + 1), total)
        if c1 <= c0:
            continue
        if c0 > col:
            yield col, c0, None
        yield c0, c1, action
        col = c1
    if col < total:
        yield col, total, None


def _label(action: Action | None, span: int) -> str:
    if action is None:
        return _IDLE * span
    text = str(action)
    if span > len(text):
        return text.ljust(span)
    short = action.kind.value if action.kind.is_compute else action.kind.value[0].lower()
    return (short * span)[:span]


_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _time_unit(makespan: float, unit: str | None) -> tuple[float, str]:
    """``(factor, label)`` that shows times given in ``unit`` ("s", "ms", "us") in the
    largest unit where ``makespan`` is at least 1; ``(1.0, "")`` for abstract costs (None).

    Example:
        >>> _time_unit(0.0119, "s"), _time_unit(2.5, "s"), _time_unit(3.0, None)
        ((1000.0, 'ms'), (1.0, 's'), (1.0, ''))
    """
    if unit is None:
        return 1.0, ""
    if unit not in _SECONDS:
        raise ValueError(f"time_unit must be one of {', '.join(map(repr, _SECONDS))} (what the simulation's "
                         f"times are in) or None for abstract costs; got {unit!r}")
    seconds = makespan * _SECONDS[unit]
    label = next((u for u, size in _SECONDS.items() if seconds >= size), "us")
    return _SECONDS[unit] / _SECONDS[label], label


def _summary(sim: Any, unit: tuple[float, str] = (1.0, "")) -> str:
    factor, label = unit
    span = f"{sim.makespan * factor:.3g} {label}" if label else f"{sim.makespan:g}"
    parts = [f"{sim.num_ranks} ranks", f"makespan {span}"]
    if getattr(sim, "bubble_fraction", None) is not None:
        parts.append(f"bubble {sim.bubble_fraction:.1%}")
    return ", ".join(parts)


def _peaks(sim: Any) -> str | None:
    peaks = getattr(sim, "peak_activations", None)
    if not peaks:
        return None
    return "peak activations: " + " ".join(f"r{r}={n}" for r, n in sorted(peaks.items()))


def _tick_step(scale: float, min_gap: float) -> float:
    """A round time step (1, 2, 5, 10, 20, 50 ...) at least ``min_gap`` columns/pixels apart."""
    step = 1.0
    while step * scale < min_gap:
        step *= 2 if str(step)[0] in "15" else 2.5
    return step


def _ruler(makespan: float, scale: float, total: int, indent: int) -> str:
    """A time axis: tick labels at round times, spaced so they do not collide."""
    step = _tick_step(scale, 6)
    line = [" "] * (total + 8)
    t = 0.0
    while t <= makespan + 1e-9:
        col, text = round(t * scale), f"{t:g}"
        if all(c == " " for c in line[max(0, col - 1) : col + len(text) + 1]):
            line[col : col + len(text)] = text
        t += step
    return " " * indent + "".join(line).rstrip()


# -- plain text ----------------------------------------------------------------


def render_text(sim: Any, width: int | None = None) -> str:
    """The timeline as plain text, one row per rank; ``.`` is idle time.

    Args:
        sim: a ``Simulation`` (see the module docstring for what is read).
        width: squeeze the timeline into this many columns (labels shorten).

    Example:
        >>> print(render_text(sim))  # doctest: +SKIP
        2 ranks, makespan 6, bubble 33.3%
                0   1   2   3 ...
        rank 0 |0F0 0F1 ........0B0 0B1 |
    """
    scale = _scale(sim, width)
    total = max(1, round(sim.makespan * scale))
    spans = _spans(sim)
    label_w = len(f"rank {max(spans, default=0)}")
    lines = [_summary(sim), _ruler(sim.makespan, scale, total, label_w + 2)]
    for r, entries in spans.items():
        row = "".join(_label(a, c1 - c0) for c0, c1, a in _segments(entries, scale, total))
        lines.append(f"{f'rank {r}'.ljust(label_w)} |{row}|")
    peaks = _peaks(sim)
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
        natural = round(self.sim.makespan * _scale(self.sim, None)) + 12
        return Measurement(min(20, natural), natural)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        sim = self.sim
        spans = _spans(sim)
        label_w = len(f"rank {max(spans, default=0)}")
        avail = max(1, options.max_width - label_w - 3)
        scale = _scale(sim, None if self.wrap else avail)
        total = max(1, round(sim.makespan * scale))
        yield Text(_summary(sim), style="bold")
        ruler = _ruler(sim.makespan, scale, total, 0)
        for b0, b1 in _bands(spans, scale, total, avail):  # one band unless wrapping a wide timeline
            yield Text(" " * (label_w + 2) + ruler[b0:b1].rstrip(), style="dim", no_wrap=True, overflow="crop")
            for r, entries in spans.items():
                row = Text(f"{f'rank {r}'.ljust(label_w)} |", no_wrap=True, overflow="crop")
                for c0, c1, a in _segments(entries, scale, total):
                    lo, hi = max(c0, b0), min(c1, b1)
                    if lo < hi:
                        style = "dim" if a is None else _RICH_STYLES[_kind_key(a)]
                        row.append(_label(a, c1 - c0)[lo - c0 : hi - c0], style=style)
                row.append("|")
                yield row
        legend = Text("legend: ")
        for key, style in _RICH_STYLES.items():
            legend.append(f" {key} ", style=style)
            legend.append(" ")
        legend.append(" . idle", style="dim")
        yield legend
        peaks = _peaks(sim)
        if peaks:
            yield Text(peaks, style="dim")


def _bands(spans: dict[int, list[tuple[float, float, Action]]], scale: float, total: int,
           avail: int) -> Iterator[tuple[int, int]]:
    """Column ranges of at most ``avail`` columns, each ending where no rank's action is
    cut in two (an idle stretch may be), unless no such column is in reach."""
    inside = [False] * (total + 1)  # inside[c]: column c falls strictly inside an action
    for entries in spans.values():
        for c0, c1, a in _segments(entries, scale, total):
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
        >>> rich.print(render_rich(sim, wrap=True))  # doctest: +SKIP
    """
    return TimelineView(sim, wrap=wrap)


# -- SVG / HTML --------------------------------------------------------------------

_ROW_H, _GAP, _LEFT, _TOP, _CHAR_W, _AXIS_H = 22, 4, 64, 28, 6.6, 22


def render_svg(sim: Any, path: str | Path | None = None, *, px_per_unit: float | None = None,
               title: str | None = None, time_unit: str | None = None) -> str:
    """The timeline as an SVG: one row per rank, a box per action coloured by kind.

    Args:
        sim: a ``Simulation``.
        path: also write the SVG there.
        px_per_unit: horizontal pixels per unit of time (default: fit labels,
            at most ~1600 px wide).
        title: what the timeline shows (e.g. the schedule's name and sizes), put
            before the summary in the heading.
        time_unit: what the simulation's times are in ("s", "ms", "us"; a plan's
            candidates are simulated in seconds): the heading, axis and tooltips show
            them in the unit that suits the makespan (``makespan 11.9 ms``, axis
            ``time/ms``). None: abstract costs, shown as plain numbers.

    Returns:
        The SVG document text.

    Example:
        >>> svg = render_svg(sim, "timeline.svg")  # doctest: +SKIP
        >>> svg = render_svg(candidate.simulation, title="1F1B, m=8", time_unit="s")  # doctest: +SKIP
    """
    spans = _spans(sim)
    px = px_per_unit or _svg_scale(sim, spans)
    unit = _time_unit(sim.makespan, time_unit)
    plot_w = max(sim.makespan * px, 1.0)
    width = _LEFT + plot_w + 12
    rows_end = _TOP + len(spans) * (_ROW_H + _GAP)
    height = rows_end + _AXIS_H + 48
    heading = f"{title}: {_summary(sim, unit)}" if title else _summary(sim, unit)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="11">',
        f'<text x="4" y="16" font-weight="bold">{html.escape(heading)}</text>',
    ]
    for row, (r, entries) in enumerate(spans.items()):
        y = _TOP + row * (_ROW_H + _GAP)
        out.append(f'<text x="4" y="{y + 15}">rank {r}</text>')
        out.append(
            f'<rect x="{_LEFT}" y="{y}" width="{plot_w:.1f}" height="{_ROW_H}" fill="#f4f4f4" class="idle"/>'
        )
        out.extend(_svg_box(r, y, start, end, a, px, unit) for start, end, a in entries)
    out.append(_svg_axis(sim.makespan, px, rows_end, unit))
    out.append(_svg_legend(rows_end + _AXIS_H + 12))
    out.append("</svg>")
    svg = "\n".join(out)
    if path is not None:
        Path(path).write_text(svg)
    return svg


def _svg_scale(sim: Any, spans: dict[int, list[tuple[float, float, Action]]]) -> float:
    entries = [e for rows in spans.values() for e in rows]
    if not entries or sim.makespan <= 0:
        return 40.0
    shortest = min(end - start for start, end, _ in entries)
    label = max(len(str(a)) for _, _, a in entries)
    return min((label * _CHAR_W + 6) / shortest, 1600 / sim.makespan)


def _svg_box(rank: int, y: float, start: float, end: float, action: Action, px: float,
             unit: tuple[float, str] = (1.0, "")) -> str:
    x, w = _LEFT + start * px, (end - start) * px
    key = _kind_key(action)
    text = str(action)
    factor, label = unit
    span = f"[{start * factor:.4g}, {end * factor:.4g}) {label}" if label else f"[{start:g}, {end:g})"
    tip = html.escape(f"rank {rank}: {text} {span}")
    box = (
        f'<g class="action kind-{key}"><title>{tip}</title>'
        f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_ROW_H}" fill="{KIND_COLORS[key]}" '
        f'stroke="white" stroke-width="1"/>'
    )
    if w >= len(text) * _CHAR_W + 2:
        box += f'<text x="{x + w / 2:.1f}" y="{y + 15}" text-anchor="middle">{html.escape(text)}</text>'
    return box + "</g>"


def _svg_axis(makespan: float, px: float, y: float, unit: tuple[float, str] = (1.0, "")) -> str:
    """A time axis under the rows: a line, ticks at round times (in the display unit),
    their labels, "time" and the unit."""
    factor, label = unit
    parts = [f'<line x1="{_LEFT}" y1="{y}" x2="{_LEFT + makespan * px:.1f}" y2="{y}" stroke="#666"/>']
    step, t = _tick_step(px / factor, 36), 0.0  # t and step in display units
    while t <= makespan * factor + 1e-9:
        x = _LEFT + t / factor * px
        parts.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#666"/>')
        parts.append(f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle">{t:g}</text>')
        t += step
    parts.append(f'<text x="4" y="{y + 15}">{f"time/{label}" if label else "time"}</text>')
    return '<g class="axis">' + "".join(parts) + "</g>"


def _svg_legend(y: float) -> str:
    parts, x = [], float(_LEFT)
    for key, color in [*KIND_COLORS.items(), ("idle", "#f4f4f4")]:
        parts.append(f'<rect x="{x:.0f}" y="{y}" width="12" height="12" fill="{color}" stroke="#999"/>')
        parts.append(f'<text x="{x + 16:.0f}" y="{y + 10}">{key}</text>')
        x += 16 + len(key) * _CHAR_W + 14
    return '<g class="legend">' + "".join(parts) + "</g>"


def render_html(sim: Any) -> str:
    """HTML for notebooks (``_repr_html_``): the SVG timeline plus peak activations."""
    peaks = _peaks(sim)
    note = f"<div><small>{html.escape(peaks)}</small></div>" if peaks else ""
    return f'<div class="pippy-split-simulation">{render_svg(sim)}{note}</div>'


# -- schedules and tables (notebooks) ---------------------------------------------

SVG_MAX_ACTIONS = 2000
"""A bigger order's timeline is too wide to read inline; the table still shows."""


def html_table(rows: Sequence[tuple[str, str]], header: Sequence[str] | None = None,
               body: Sequence[Sequence[str]] | None = None, caption: str | None = None) -> str:
    """A small HTML table: ``rows`` as ``name | value`` lines, or ``header`` over ``body``.

    Every cell is escaped. Used by the notebook reprs (``_repr_html_``) of schedules and plans.

    Example:
        >>> html_table([("ranks", "2")])
        '<table><tr><th style="text-align:left">ranks</th><td style="text-align:left">2</td></tr></table>'
    """
    left = ' style="text-align:left"'
    out = ["<table>"]
    if caption:
        out.append(f"<caption{left}>{html.escape(caption)}</caption>")
    if header:
        out.append("<tr>" + "".join(f"<th{left}>{html.escape(h)}</th>" for h in header) + "</tr>")
    for cells in body or []:
        out.append("<tr>" + "".join(f"<td{left}>{html.escape(c)}</td>" for c in cells) + "</tr>")
    for name, value in rows:
        out.append(f"<tr><th{left}>{html.escape(name)}</th><td{left}>{html.escape(value)}</td></tr>")
    return "".join(out) + "</table>"


def schedule_rows(sched: Any) -> list[tuple[str, str]]:
    """``(name, value)`` lines that describe a schedule object: its stages, ranks,
    microbatches and placement (read duck-typed: ``stages``, ``rank``, ``world``,
    ``num_stages``, ``n_microbatches``, ``placement_name``, ``placement``, ``actions``)."""
    mine = [s.stage_index for s in sched.stages]
    return [
        ("schedule", type(sched).__name__),
        ("this rank", f"{sched.rank} of {sched.world}, holds stages {mine} of {sched.num_stages}"),
        ("n_microbatches", str(sched.n_microbatches)),
        ("placement", f"{sched.placement_name}: "
                      + ", ".join(f"stage {s} -> rank {r}" for s, r in sorted(sched.placement.items()))),
        ("actions on this rank", f"{len(sched.actions)}, lowered (with any sends and receives)"),
    ]


def render_schedule_html(sched: Any, sim: Any | None) -> str:
    """HTML for a schedule object's ``_repr_html_``: a table of what it runs and, when
    given, the simulated timeline of its whole order (``sim``) as an SVG.

    Example:
        >>> sched._repr_html_()[:40]  # doctest: +SKIP
        '<div class="pippy-split-schedule"><table>'
    """
    parts = [html_table(schedule_rows(sched))]
    if sim is not None:
        title = f"{type(sched).__name__}, m={sched.n_microbatches} (unit costs)"
        parts.append(render_svg(sim, title=title))
    return f'<div class="pippy-split-schedule">{"".join(parts)}</div>'


def placement_style(sched: Any) -> str:
    """The placement a schedule object runs under, by name (its ``placement_name``)."""
    return sched.placement_name
