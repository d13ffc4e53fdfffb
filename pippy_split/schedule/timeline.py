"""What every picture of a simulated timeline shares: colours per action kind, spans per rank,
the quantisation into columns, labels, time units and the one-line summary.

Internal to the schedule layer's renderers (:mod:`.render` for text and ``rich``,
:mod:`.render_web` for SVG and HTML); imports no ``rich``.
"""

from __future__ import annotations

from typing import Any, Iterator

from .actions import Action

__all__ = ["KIND_COLORS", "kind_key", "timeline_spans", "columns_per_unit", "segments", "cell_label", "display_unit",
           "summary_line", "peaks_line", "tick_step", "ruler_line", "Segment"]

KIND_COLORS: dict[str, str] = {
    "F": "#4c8be8",  # forward: blue
    "B": "#e8804c",  # full backward: orange
    "I": "#e8c84c",  # input-grad backward: yellow
    "W": "#5cb85c",  # weight-grad backward: green
    "comm": "#b0b0b0",  # SEND/RECV: grey
}
"""Fill colour per action kind, shared by the SVG and the rich renderings."""

IDLE = "."
Segment = tuple[int, int, "Action | None"]  # (first column, end column, action or idle)


def kind_key(action: Action) -> str:
    return action.kind.value if action.kind.is_compute else "comm"


# -- timelines: shared quantisation -------------------------------------------


def timeline_spans(sim: Any) -> dict[int, list[tuple[float, float, Action]]]:
    """Timeline entries with a positive duration, per rank, every rank present."""
    ranks = range(int(getattr(sim, "num_ranks", 0) or 0)) or sorted(sim.timeline)
    out: dict[int, list[tuple[float, float, Action]]] = {r: [] for r in ranks}
    for r, entries in sim.timeline.items():
        out.setdefault(r, []).extend(sorted((e for e in entries if e[1] > e[0]), key=lambda e: e[0]))
    return out


def columns_per_unit(sim: Any, width: int | None) -> float:
    """Columns per unit of time: the shortest action gets room for its label."""
    spans = [e for entries in timeline_spans(sim).values() for e in entries]
    if not spans or sim.makespan <= 0:
        return 1.0
    shortest = min(end - start for start, end, _ in spans)
    label = max(len(str(a)) for _, _, a in spans) + 1
    scale = label / shortest
    if width is not None and sim.makespan * scale > width:
        scale = max(width, 1) / sim.makespan
    return scale


def segments(entries: list[tuple[float, float, Action]], scale: float, total: int) -> Iterator[Segment]:
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


def cell_label(action: Action | None, span: int) -> str:
    if action is None:
        return IDLE * span
    text = str(action)
    if span > len(text):
        return text.ljust(span)
    short = action.kind.value if action.kind.is_compute else action.kind.value[0].lower()
    return (short * span)[:span]


SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def display_unit(makespan: float, unit: str | None) -> tuple[float, str]:
    """``(factor, label)`` that shows times given in ``unit`` ("s", "ms", "us") in the
    largest unit where ``makespan`` is at least 1; ``(1.0, "")`` for abstract costs (None).

    Example:
        >>> display_unit(0.0119, "s"), display_unit(2.5, "s"), display_unit(3.0, None)
        ((1000.0, 'ms'), (1.0, 's'), (1.0, ''))
    """
    if unit is None:
        return 1.0, ""
    if unit not in SECONDS:
        raise ValueError(f"time_unit must be one of {', '.join(map(repr, SECONDS))} (what the simulation's "
                         f"times are in) or None for abstract costs; got {unit!r}")
    seconds = makespan * SECONDS[unit]
    label = next((u for u, size in SECONDS.items() if seconds >= size), "us")
    return SECONDS[unit] / SECONDS[label], label


def summary_line(sim: Any, unit: tuple[float, str] = (1.0, "")) -> str:
    factor, label = unit
    span = f"{sim.makespan * factor:.3g} {label}" if label else f"{sim.makespan:g}"
    parts = [f"{sim.num_ranks} ranks", f"makespan {span}"]
    if getattr(sim, "bubble_fraction", None) is not None:
        parts.append(f"bubble {sim.bubble_fraction:.1%}")
    return ", ".join(parts)


def peaks_line(sim: Any) -> str | None:
    peaks = getattr(sim, "peak_activations", None)
    if not peaks:
        return None
    return "peak activations: " + " ".join(f"r{r}={n}" for r, n in sorted(peaks.items()))


def tick_step(scale: float, min_gap: float) -> float:
    """A round time step (1, 2, 5, 10, 20, 50 ...) at least ``min_gap`` columns/pixels apart."""
    step = 1.0
    while step * scale < min_gap:
        step *= 2 if str(step)[0] in "15" else 2.5
    return step


def ruler_line(makespan: float, scale: float, total: int, indent: int) -> str:
    """A time axis: tick labels at round times, spaced so they do not collide."""
    step = tick_step(scale, 6)
    line = [" "] * (total + 8)
    t = 0.0
    while t <= makespan + 1e-9:
        col, text = round(t * scale), f"{t:g}"
        if all(c == " " for c in line[max(0, col - 1) : col + len(text) + 1]):
            line[col : col + len(text)] = text
        t += step
    return " " * indent + "".join(line).rstrip()
