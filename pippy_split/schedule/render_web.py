"""Pictures of schedules for browsers and notebooks: SVG timelines and HTML tables.

Part of the schedule layer's pictures (beside :mod:`.render`, text and ``rich``); imports
no ``rich``. ``Simulation.to_svg`` / ``_repr_html_``, a schedule's ``_repr_html_`` and the
plan's reprs call these.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from .actions import Action
from .timeline import KIND_COLORS, display_unit, kind_key, peaks_line, summary_line, tick_step, timeline_spans

__all__ = ["render_svg", "render_html", "html_table", "schedule_rows", "render_schedule_html", "DrawnSchedule",
           "SVG_MAX_ACTIONS"]

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
        >>> from pippy_split.schedule import get_schedule_class, simulate
        >>> sim = simulate(get_schedule_class("1F1B").compute_order(num_ranks=2, n_microbatches=8),
        ...                costs={"F": 0.001, "B": 0.002})  # seconds, as a plan's candidates
        >>> svg = render_svg(sim, title="1F1B, m=8", time_unit="s")  # render_svg(sim, "t.svg") also writes it
        >>> svg.startswith("<svg"), "time/ms" in svg
        (True, True)
    """
    spans = timeline_spans(sim)
    px = px_per_unit or _svg_scale(sim, spans)
    unit = display_unit(sim.makespan, time_unit)
    plot_w = max(sim.makespan * px, 1.0)
    width = _LEFT + plot_w + 12
    rows_end = _TOP + len(spans) * (_ROW_H + _GAP)
    height = rows_end + _AXIS_H + 48
    heading = f"{title}: {summary_line(sim, unit)}" if title else summary_line(sim, unit)
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
    key = kind_key(action)
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
    step, t = tick_step(px / factor, 36), 0.0  # t and step in display units
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
    peaks = peaks_line(sim)
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


class _HasStageIndex(Protocol):
    @property
    def stage_index(self) -> int: ...


class DrawnSchedule(Protocol):
    """What a schedule's picture reads of the schedule object (a
    :class:`~.pipeline_schedule.PipelineSchedule`, which draws itself with this module and so
    cannot be imported here)."""

    @property
    def stages(self) -> Sequence[_HasStageIndex]: ...
    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def n_microbatches(self) -> int: ...
    @property
    def placement_name(self) -> str: ...
    @property
    def placement(self) -> Mapping[int, int]: ...
    @property
    def actions(self) -> Sequence[Action]: ...


def schedule_rows(sched: DrawnSchedule) -> list[tuple[str, str]]:
    """``(name, value)`` lines that describe a schedule object: its stages, ranks,
    microbatches and placement."""
    mine = [s.stage_index for s in sched.stages]
    return [
        ("schedule", type(sched).__name__),
        ("this rank", f"{sched.rank} of {sched.world}, holds stages {mine} of {sched.num_stages}"),
        ("n_microbatches", str(sched.n_microbatches)),
        ("placement", f"{sched.placement_name}: "
                      + ", ".join(f"stage {s} -> rank {r}" for s, r in sorted(sched.placement.items()))),
        ("actions on this rank", f"{len(sched.actions)}, lowered (with any sends and receives)"),
    ]


def render_schedule_html(sched: DrawnSchedule, sim: Any | None) -> str:
    """HTML for a schedule object's ``_repr_html_``: a table of what it runs and, when
    given, the simulated timeline of its whole order (``sim``) as an SVG.

    Example:
        >>> import torch
        >>> import pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        >>> sched = ps.build_schedule(ps.pipeline(model, ["2"], (torch.randn(2, 4),)), "ZBVZeroBubble", 4)
        >>> sched._repr_html_()[:40]
        '<div class="pippy-split-schedule"><table'
    """
    parts = [html_table(schedule_rows(sched))]
    if sim is not None:
        title = f"{type(sched).__name__}, m={sched.n_microbatches} (unit costs)"
        parts.append(render_svg(sim, title=title))
    return f'<div class="pippy-split-schedule">{"".join(parts)}</div>'

