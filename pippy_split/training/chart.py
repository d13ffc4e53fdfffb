"""A run's loss and throughput as a chart a person can open: ``metrics.svg`` beside ``metrics.jsonl``.

Where this sits: after a ``pippy-split train`` run on rank 0 (:mod:`pippy_split.training.loop`),
and on demand for any run directory (``pippy-split plot RUN_DIR``). Plain SVG written here
(no plotting library: the job's dependencies stay torch, sympy and rich): the training loss
per step (and the held-out loss where it was evaluated) above, tokens per second below, each
with its range marked.

Example:
    >>> import json, os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    ...     for s in range(1, 5):
    ...         print(json.dumps({"step": s, "loss": 3.0 / s, "tokens_per_s": 100.0 * s}), file=f)
    >>> path = write_chart(d)
    >>> os.path.basename(path), open(path).read().count("<polyline")
    ('metrics.svg', 2)
"""

from __future__ import annotations

import json
import os
from html import escape

from .errors import JobError
from .run_dir import METRICS_FILE

__all__ = ["write_chart", "CHART_FILE", "read_metrics"]

CHART_FILE = "metrics.svg"
_W, _PANEL_H, _PAD_L, _PAD_R, _PAD_T, _GAP = 640, 180, 64, 16, 28, 48


def read_metrics(run_dir: str) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (a line that is not JSON is skipped: a run killed mid-write)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise JobError(f"{run_dir} holds no {METRICS_FILE} (the directory of a pippy-split train run)")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("step"), int):
                records.append(value)
    return records


def write_chart(run_dir: str) -> str:
    """``run_dir/metrics.svg`` from ``run_dir/metrics.jsonl``: loss (and held-out loss) and tokens/s per step."""
    records = read_metrics(run_dir)
    loss = [(r["step"], float(r["loss"])) for r in records if r.get("loss") is not None]
    held = [(r["step"], float(r["eval_loss"])) for r in records if r.get("eval_loss") is not None]
    speed = [(r["step"], float(r["tokens_per_s"])) for r in records if r.get("tokens_per_s") is not None]
    if not loss:
        raise JobError(f"{os.path.join(run_dir, METRICS_FILE)} records no step's loss yet: nothing to plot")
    steps = [s for s, _ in loss + held + speed]
    x_range = (min(steps), max(max(steps), min(steps) + 1))
    height = _PAD_T + 2 * _PANEL_H + _GAP + 24
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{_PAD_L}" y="16" font-size="13">{escape(os.path.basename(os.path.abspath(run_dir)))}'
             f': {len(loss)} steps</text>']
    parts += _panel("loss" + (" (dots: held-out)" if held else ""), [(loss, "#1f77b4")], held, x_range, _PAD_T)
    if speed:
        parts += _panel("tokens/s", [(speed, "#2ca02c")], [], x_range, _PAD_T + _PANEL_H + _GAP)
    parts.append(f'<text x="{_W // 2}" y="{height - 6}" text-anchor="middle">step</text></svg>')
    path = os.path.join(run_dir, CHART_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts) + "\n")
    return path


def _panel(title: str, lines: list[tuple[list[tuple[int, float]], str]], dots: list[tuple[int, float]],
           x_range: tuple[int, int], top: int) -> list[str]:
    """One chart: a frame, the y range's ends and the x range's, each line, the dots."""
    values = [v for pts, _ in lines for _, v in pts] + [v for _, v in dots]
    lo, hi = min(values), max(values)
    hi = hi if hi > lo else lo + 1.0
    left, right, bottom = _PAD_L, _W - _PAD_R, top + _PANEL_H

    def xy(step: int, value: float) -> tuple[float, float]:
        x = left + (step - x_range[0]) / (x_range[1] - x_range[0]) * (right - left)
        return x, bottom - (value - lo) / (hi - lo) * _PANEL_H

    out = [f'<text x="{left}" y="{top - 6}" font-size="12">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{right - left}" height="{_PANEL_H}" fill="none" stroke="#999"/>',
           f'<text x="{left - 4}" y="{top + 10}" text-anchor="end">{_num(hi)}</text>',
           f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{_num(lo)}</text>',
           f'<text x="{left}" y="{bottom + 14}">{x_range[0]}</text>',
           f'<text x="{right}" y="{bottom + 14}" text-anchor="end">{x_range[1]}</text>']
    for pts, colour in lines:
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in pts))
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
    for s, v in dots:
        x, y = xy(s, v)
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#d62728"/>')
    return out


def _num(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
