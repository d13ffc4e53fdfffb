"""A check that fails on one rank only stops every rank at once, naming that rank and its cause.

The schedules here wait up to 600 s for a message; the harness gives the ranks 100 s
and pytest 150 s, so a rank left waiting for the failed one fails the test."""

from __future__ import annotations

import pytest

from pippy_split.testing import run_ranks

from .rank_bodies import one_rank_fails_its_checks


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_bad_kwarg_or_a_missing_loss_fn_on_one_rank_reaches_the_others():
    results = run_ranks(one_rank_fails_its_checks, 3, timeout=100)
    kind, msg = results[0][0]
    assert kind == "MicrobatchError" and "'mask'" in msg and "6" in msg, msg
    for rank in (1, 2):
        kind, msg = results[rank][0]
        assert kind == "PipelineError", msg
        assert f"rank {rank}: step() stopped before any communication because rank 0 failed" in msg
        assert "MicrobatchError" in msg and "'mask'" in msg
    kind, msg = results[2][1]
    assert kind == "PipelineError" and "no loss_fn" in msg
    for rank in (0, 1):
        kind, msg = results[rank][1]
        assert kind == "PipelineError" and "rank 2: PipelineError" in msg and "no loss_fn" in msg, msg
    assert all(r[2] == ("ok", "") for r in results), [r[2] for r in results]
    assert len({r[3] for r in results}) == 1  # the schedule works after a refused step
