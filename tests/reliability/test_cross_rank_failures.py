"""A check that fails on one rank only stops every rank at once, naming that rank and its cause;
so does a failure in the middle of a step, while the failing process lives on.

The schedules here wait up to 600 s for a message; the harness gives the ranks 100 s
and pytest 150 s, so a rank left waiting for the failed one fails the test."""

from __future__ import annotations

import pytest

from pippy_split.testing import run_ranks

from .rank_bodies import (
    a_bad_target_after_a_good_step,
    a_target_that_does_not_fit,
    fails_mid_step_and_lives_on,
    one_rank_fails_its_checks,
)


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


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("breaks_own", [True, False], ids=["connections-close", "store-only"])
def test_a_rank_failing_mid_step_and_living_on_stops_every_rank_within_seconds(breaks_own):
    # 3 ranks, 1F1B; rank 2 (the last stage) raises in its forward of microbatch 2, catches it,
    # calls step() again and sleeps. Rank 0 exchanges nothing with rank 2 directly.
    results = run_ranks(fails_mid_step_and_lives_on, 3, 2, 600.0, breaks_own, timeout=100)
    (kind, msg), _, (again_kind, again_msg), again_took = results[2]
    assert kind == "PipelineError" and "a bad batch" in msg, msg  # its own error, as raised
    assert again_kind == "PipelineAborted" and "rank 2 failed in 2F2" in again_msg, again_msg
    assert again_took < 5, again_took
    for rank in (0, 1):
        (kind, msg), took, (again_kind, again_msg), again_took = results[rank]
        assert kind == "PipelineAborted", msg
        assert f"rank {rank}: step() stopped because rank 2 failed in 2F2 (stage 2, microbatch 2, forward)" in msg
        assert "ValueError: a bad batch seen by the user's hook" in msg
        assert took < 20, f"rank {rank} raised after {took:.1f} s"  # a bound for a hang, not a speed test
        assert again_kind == "PipelineAborted" and "refused" in again_msg and "rank 2 failed" in again_msg
        assert again_took < 5, again_took


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_a_target_that_does_not_fit_stops_every_rank_before_any_message():
    results = run_ranks(a_target_that_does_not_fit, 2, timeout=100)
    kind, msg = results[1][0]
    assert kind == "PipelineError", msg
    assert "stage 1 (the last), microbatch 0: the target does not fit the output" in msg, msg
    assert "(4, 16)" in msg and "(3, 16)" in msg, msg
    kind, msg = results[0][0]
    assert kind == "PipelineError" and "stopped before any communication because rank 1 failed" in msg, msg
    assert all(r[1] == ("ok", "") for r in results), [r[1] for r in results]
    assert results[0][2] == results[1][2]  # the next step works, on every rank alike


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("agree_every_step", [False, True], ids=["no-collective", "agree-every-step"])
def test_a_bad_target_after_a_good_step_stops_every_rank_within_seconds(agree_every_step):
    """Once a step has run, a static-shape step runs no collective before its messages: a check
    failing on one rank then reaches the others through the failure channel (named, within
    seconds) instead of the agreement; ``agree_every_step`` keeps the schedule usable instead."""
    results = run_ranks(a_bad_target_after_a_good_step, 2, agree_every_step, timeout=100)
    assert all(r[0] == ("ok", "") for r in results), [r[0] for r in results]
    kind, msg = results[1][1]
    assert kind == "PipelineError" and "the target does not fit the output" in msg, msg
    kind, msg = results[0][1]
    if agree_every_step:
        assert kind == "PipelineError" and "stopped before any communication because rank 1 failed" in msg, msg
        assert all(r[3] == ("ok", "") for r in results), [r[3] for r in results]
        return
    assert kind == "PipelineAborted", msg
    assert "rank 1 failed in its own checks before its first message" in msg and "target does not fit" in msg, msg
    assert results[0][2] < 20, f"rank 0 raised after {results[0][2]:.1f} s"  # a bound for a hang, not a speed test
    for rank in (0, 1):
        kind, msg = results[rank][3]
        assert kind == "PipelineAborted" and "refused" in msg, msg
