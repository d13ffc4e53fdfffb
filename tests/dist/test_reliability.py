"""Long runs stay exact, memory does not creep, undeclared shape changes are named.

In-process mistakes (bad loss, failing forward, ...) are in tests/reliability/."""

from __future__ import annotations

import pytest

from pippy_split.testing import RankFailure, run_ranks

from .bodies import no_creep, shape_change, trajectory, unsplit_trajectory

STEPS = 20


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,schedule,world", [("tiny_gpt", "1F1B", 4), ("tiny_gpt", "ZBVZeroBubble", 2),
                                                 ("fan_out_skip", "1F1B", 3)])
def test_twenty_adamw_steps_follow_the_unsplit_trajectory(name, schedule, world):
    results = run_ranks(trajectory, world, name, schedule, STEPS, 4, timeout=200)
    expected = unsplit_trajectory(name, STEPS, 4)
    for losses in results:  # sched.loss is shared with every rank
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, expected)):
            assert abs(got - want) <= 1e-5, f"step {step}: {got} vs {want}"
    assert expected[-1] < expected[0]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_hundred_steps_with_alternating_lengths_hold_nothing_between_steps():
    results = run_ranks(no_creep, 2, 200, timeout=280)
    for sizes in results:
        assert set(sizes) == {(0, 0, 0, 0, 0, 0, 0)}, sorted(set(sizes))[:5]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_undeclared_shape_change_names_stage_microbatch_and_peer():
    with pytest.raises(RankFailure) as info:
        run_ranks(shape_change, 3, timeout=100)
    sender = info.value.failures[0]
    assert "stage 0, microbatch 0, forward to stage 1 (rank 1): expected shape (2, 6)" in sender
    assert "got (3, 6)" in sender


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resume_at_step_ten_in_fresh_processes_continues_exactly(tmp_path):
    from .bodies import resumable

    path = str(tmp_path / "ckpt")
    first = run_ranks(resumable, 2, "tiny_gpt", "ZBVZeroBubble", path, 0, 10, 4, timeout=200)
    second = run_ranks(resumable, 2, "tiny_gpt", "ZBVZeroBubble", path, 10, 20, 4, timeout=200)
    expected = unsplit_trajectory("tiny_gpt", 20, 4)
    for a, b in zip(first, second):
        for step, (got, want) in enumerate(zip(a + b, expected)):
            assert abs(got - want) <= 1e-5, f"step {step}: {got} vs {want}"
