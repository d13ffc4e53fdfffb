"""GPU tier (marker ``gpu``; skipped without CUDA): the dist bodies on CUDA devices.

One process holding every stage on cuda:0 for the multi-stage schedules, and NCCL over
one rank per GPU where there are at least two (NCCL matches messages by order only,
which is what the lowered orders guarantee).
"""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks

from ..dist.ordered_bodies import skip_stack_reference, skip_stack_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEDULES = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _assert_exact(results, n_mb):
    ref_loss, ref_grads = skip_stack_reference(n_mb)
    seen = set()
    for r in results:
        assert abs(r["loss"] - ref_loss) < 1e-5
        for fqn, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[fqn], atol=1e-5, rtol=1e-5)
            seen.add(fqn)
    assert seen == set(ref_grads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
def test_all_stages_in_one_process_on_cuda(schedule):
    torch.backends.cuda.matmul.allow_tf32 = False
    _assert_exact([skip_stack_step(0, 1, schedule, 4, "cuda")], 4)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs 2 GPUs")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_nccl_ranks(schedule):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    if world == 2 and schedule in ("ZBVZeroBubble", "DualPipeV"):
        pytest.skip("8 stages at 2 per rank need 4 GPUs")
    n_mb = 8 if schedule == "DualPipeV" else 4
    _assert_exact(run_ranks(skip_stack_step, world, schedule, n_mb, "cuda", backend="nccl", timeout=240), n_mb)
