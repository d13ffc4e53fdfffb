"""A steady-state step reads no tensor value on the host per microbatch (issue 31): at most one
read per step, for every schedule, with the kit on (selective checkpointing, bf16, loss_count,
clip), on 2 gloo ranks. Counted, never timed."""

from __future__ import annotations

import pytest

from pippy_split.schedule.orders import ORDERS
from pippy_split.testing import run_ranks

from .host_sync_bodies import dynamic_shape_counts, steady_state_counts


@pytest.fixture(scope="module")
def counts():
    return {kit: run_ranks(steady_state_counts, 2, kit, timeout=400) for kit in (False, True)}


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kit", [False, True], ids=["plain", "kit"])
def test_at_most_one_host_read_per_step(counts, kit):
    for rank, per_schedule in enumerate(counts[kit]):
        assert set(per_schedule) == set(ORDERS)
        for name, c in per_schedule.items():
            reads = {k[1]: v for k, v in c.items() if k[0] == "read"}
            assert sum(reads.values()) <= 1, f"rank {rank}, {name}: host reads per step {reads}"


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kit", [False, True], ids=["plain", "kit"])
def test_collectives_per_steady_step_besides_the_pipeline_messages(counts, kit):
    """Static shapes, nothing to agree: no collective (the loss travels point to point). With
    ``loss_count``: the one agreement carrying its items; clip_grad_norm_ adds its own norm
    all-reduce."""
    for rank, per_schedule in enumerate(counts[kit]):
        for name, c in per_schedule.items():
            collectives = {k[1]: v for k, v in c.items() if k[0] == "collective"}
            expected = {"all_reduce": 2} if kit else {}
            assert collectives == expected, f"rank {rank}, {name}: {collectives}"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_one_collective_per_step_with_dynamic_shapes():
    """A pipe traced with a dynamic sequence dim, every microbatch its own length: the sizes
    and the failure flags share one all-reduce; no host read beyond it."""
    for rank, c in enumerate(run_ranks(dynamic_shape_counts, 2, timeout=200)):
        collectives = {k[1]: v for k, v in c.items() if k[0] == "collective"}
        assert collectives == {"all_reduce": 1}, f"rank {rank}: {collectives}"
        reads = {k[1]: v for k, v in c.items() if k[0] == "read"}
        assert sum(reads.values()) <= 1, f"rank {rank}: host reads per step {reads}"
