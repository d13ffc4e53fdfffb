"""A step frees its autograd graphs: with the zero-bubble I/W split (whose input-grad pass
retains the graph for W) and with sent outputs released (which records what autograd
saves through saved-tensor hooks), nothing of the step's activations outlives it."""

from __future__ import annotations

import pytest

from pippy_split.testing import run_ranks


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "Interleaved1F1B"])
@pytest.mark.parametrize("release", [False, True])
def test_no_stage_output_outlives_its_step(schedule, release):
    from .lifetime_bodies import graphs_alive_after_step

    alive = run_ranks(graphs_alive_after_step, 2, schedule, release, timeout=100)
    assert alive == [0, 0]
