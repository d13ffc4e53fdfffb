"""A family's order on the other placement: kept where it runs, rejected up front where it cannot."""

from __future__ import annotations

import pytest

from pippy_split.schedule import ScheduleError, lower, stage_to_rank, validate
from pippy_split.schedule.orders import ORDERS
from pippy_split.schedule.schedules import replace_placement


def test_replace_placement_keeps_each_ranks_chunk_sequence():
    order = ORDERS["LoopedBFS"].compute_order(4, 4, 2)
    v = replace_placement(order, 8, 4, "loop", "v")
    placement = stage_to_rank(8, 4, "v")
    for rank, acts in v.items():
        assert {a.stage for a in acts if a is not None} == {s for s, r in placement.items() if r == rank}
    # loop's stage 5 is rank 1's second chunk; under V that chunk is stage 6
    assert [str(a) for a in order[1] if a is not None and a.stage == 5][:1] == ["5F0"]
    assert [str(a) for a in v[1] if a is not None and a.stage == 6][:1] == ["6F0"]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 8)])
def test_looped_bfs_runs_under_v_placement(p, m):
    v = replace_placement(ORDERS["LoopedBFS"].compute_order(p, m, 2), 2 * p, p, "loop", "v")
    validate(lower(v, None, stage_to_rank(2 * p, p, "v")), 2 * p, m)


def test_interleaved_1f1b_under_v_placement_is_rejected_with_a_schedule_error():
    v = replace_placement(ORDERS["Interleaved1F1B"].compute_order(2, 4, 2), 4, 2, "loop", "v")
    with pytest.raises(ScheduleError):
        validate(lower(v, None, stage_to_rank(4, 2, "v")), 4, 4)
