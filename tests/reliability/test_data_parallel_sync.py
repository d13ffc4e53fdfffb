"""Data-parallel gradient averaging when replicas differ in which parameters got a gradient."""

from __future__ import annotations

import pytest
import torch

from pippy_split.testing import run_ranks


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_parameter_only_one_replica_used_is_averaged_with_zero_from_the_other():
    from tests.dist.dp_bodies import branchy_pp_dp, branchy_reference

    expected = branchy_reference(2)
    results = run_ranks(branchy_pp_dp, 4, 2, timeout=100)
    for rank, grads in enumerate(results):
        for name, g in grads.items():
            assert g is not None, f"rank {rank}: {name} has no gradient after the data-parallel sync"
            torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=0, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
    assert set().union(*results) == set(expected)
