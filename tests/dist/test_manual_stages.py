"""Hand-built PipelineStages: lazy shapes from the first microbatch, declared skips."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from .bodies import manual_reference, manual_step


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_manual_stages_with_skip_match_reference(schedule):
    results = run_ranks(manual_step, 3, schedule, 4, timeout=100)
    ref_grads, ref_buffers = manual_reference(4)
    grads = {k: v for g, _ in results for k, v in g.items()}
    buffers = {k: v for _, b in results for k, v in b.items()}
    assert set(grads) == set(ref_grads)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=0)
    # Shape inference ran no extra forward: BatchNorm saw exactly the 4 real microbatches.
    for k in ref_buffers:
        torch.testing.assert_close(buffers[k], ref_buffers[k], atol=1e-6, rtol=0)
