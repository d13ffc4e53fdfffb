"""``pippy-split plot RUN_DIR``: a train run's loss and tokens/s per step as ``RUN_DIR/metrics.svg``.

Where this sits: on a run directory only (its ``metrics.jsonl``); ``train`` writes the same
chart at the end of a run (:mod:`pippy_split.training.chart`). Works on a run still going or
stopped, from the steps recorded so far.
"""

from __future__ import annotations

import argparse

from ..training.chart import write_chart
from ..training.errors import JobError, report

__all__ = ["plot_cmd"]


def plot_cmd(args: argparse.Namespace) -> int:
    """Write the chart, print its path; a directory without a record is one line (exit status 2)."""
    try:
        print(f"loss and tokens/s per step, charted: {write_chart(args.run_dir)}")
    except JobError as e:
        return report("plot", e)
    return 0
