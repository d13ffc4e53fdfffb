"""validate(): each kind of broken order raises ScheduleError at the right rank and step."""

from __future__ import annotations

import pickle
import time

import pytest

from pippy_split.schedule.actions import Action, ActionKind, Order, parse_action
from pippy_split.schedule.deps import chain_links
from pippy_split.schedule.lower import lower, split_backward
from pippy_split.schedule.placement import rank_to_stages
from pippy_split.schedule.validate import ScheduleError, validate

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def parse_order(rows: dict[int, str]) -> Order:
    return {r: [None if t == "." else parse_action(t) for t in row.split()] for r, row in rows.items()}


def bfs_order(num_ranks: int, stages_per_rank: int, m: int, style: str = "loop") -> Order:
    order: Order = {}
    for rank, stages in rank_to_stages(num_ranks * stages_per_rank, num_ranks, style).items():
        acts: list[Action | None] = [Action(s, F, mb) for s in stages for mb in range(m)]
        acts += [Action(s, B, mb) for s in reversed(stages) for mb in range(m)]
        order[rank] = acts
    return order


# 1F1B on 2 ranks, 2 microbatches, idle slots included.
GOOD = {0: "0F0 0F1 . 0B0 . 0B1", 1: ". 1F0 1B0 1F1 1B1"}


def raises_at(rows: dict[int, str] | Order, rank: int | None, step: int | None, match: str, **kw) -> ScheduleError:
    order = parse_order(rows) if isinstance(next(iter(rows.values())), str) else rows
    num_stages = kw.pop("num_stages", 2)
    m = kw.pop("m", 2)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(order, num_stages, m, **kw)
    err = info.value
    assert (err.rank, err.step) == (rank, step), str(err)
    if step is not None:
        assert err.action == order[rank][step]
    return err


def test_good_orders_pass() -> None:
    validate(parse_order(GOOD), 2, 2)
    validate(lower(parse_order(GOOD)), 2, 2)
    validate(parse_order({0: "0F0 0F1 . 0I0 0W0 . 0I1 0W1", 1: ". 1F0 1I0 1F1 1I1 1W0 1W1"}), 2, 2)
    validate(parse_order(GOOD), 2, 2, placement={0: 0, 1: 1}, links=chain_links(2))
    validate(parse_order(GOOD), 2, 2, placement="loop")


def test_missing_forward() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1B1"}, 1, 2, "1B1 has no forward 1F1")


def test_missing_forward_and_backward() -> None:
    err = raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0"}, 1, None, "forward of stage 1 mb 1 is missing")
    assert err.action == Action(1, F, 1)


def test_missing_backward() -> None:
    err = raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0"}, 1, None, "backward of stage 1 mb 1")
    assert err.action == Action(1, B, 1)


def test_duplicate_backward() -> None:
    raises_at({0: "0F0 0F1 . 0B0 . 0B1", 1: ". 1F0 1B0 1F1 1B1 1B0"}, 1, 5, "duplicate 1B0")


def test_b_and_i_for_one_microbatch() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1 1I1 1W1"}, 1, 4, "both B and I/W")


def test_backward_before_forward() -> None:
    raises_at({0: "0F0 0F1 . 0B0 . 0B1", 1: ". 1B0 1F0 1F1 1B1"}, 1, 1, "1B0 comes before its forward")


def test_w_before_i() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1W0 1I0 1I1 1W1"}, 1, 2, "1W0 comes before its 1I0")


def test_w_without_i_and_i_without_w() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 1W1"}, 1, 3, "1W1 has no 1I1")
    raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 1I1"}, 1, 3, "1I1 has no 1W1")


def test_stage_on_two_ranks() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1 1F1", 1: "1F0 1B0 1B1"}, 1, 0, "stage 1 already has actions on rank 0")


def test_stage_not_where_placement_says() -> None:
    raises_at(GOOD, 0, 0, "stage 0 is placed on rank 1", placement={0: 1, 1: 0})


def test_microbatch_out_of_range() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1 0F2", 1: "1F0 1B0 1F1 1B1"}, 0, 4, r"microbatch 2 is out of range \[0, 2\)")


def test_stage_out_of_range() -> None:
    raises_at({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1 . 2F0"}, 1, 5, r"stage 2 is out of range \[0, 2\)")


def test_stage_with_no_actions() -> None:
    err = raises_at({0: "0F0 0B0", 1: "."}, None, None, "stage 1 has no actions on any rank", m=1)
    assert err.action == Action(1, F, 0)


def test_same_rank_dependency_in_wrong_order() -> None:
    # One rank holds both stages: 1F0 needs 0F0, which this rank only runs later.
    raises_at({0: "1F0 0F0 1B0 0B0"}, 0, 0, "1F0 needs 0F0, which rank 0 runs only at step 1", m=1)


def test_compute_only_deadlock() -> None:
    # rank 0 runs 0B0 (waits for 1B0) before 0F1; rank 1 runs 1F1 (waits for 0F1) first.
    err = raises_at({0: "0F0 0B0 0F1 0B1", 1: "1F1 1F0 1B0 1B1"}, 0, 1, "deadlock")
    assert "rank 0 at step 1 (0B0) waits for 1I0 on rank 1" in str(err)
    assert "rank 1 at step 0 (1F1) waits for 0F1 on rank 0" in str(err)


def test_one_batch_may_send_and_receive_together() -> None:
    # 0SEND_F0 and 0RECV_B0 are one batch: posted together, so rank 1 gets its input
    validate(parse_order({0: "0F0 0RECV_B0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}), 2, 1)


def test_lowered_deadlock_two_ranks_receive_before_sending() -> None:
    rows = {0: "0F0 0RECV_B0 0B0 0SEND_F0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    err = raises_at(rows, 0, 1, "deadlock", m=1)
    text = str(err)
    assert "rank 0 at step 1 (0RECV_B0) waits for 1SEND_B0 from rank 1" in text
    assert "rank 1 at step 0 (1RECV_F0) waits for 0SEND_F0 from rank 0" in text
    # the table is printed with both stuck steps marked
    assert "[0RECV_B0]" in text and "[1RECV_F0]" in text
    assert "rank 0" in text.splitlines()[-2] and "rank 1" in text.splitlines()[-1]


def test_lowered_unmatched_send_and_recv() -> None:
    good = lower(parse_order(GOOD))
    no_recv = {0: good[0], 1: [a for a in good[1] if str(a) != "1RECV_F1"]}
    # rank 0's SEND is checked first (ranks in order)
    raises_at(no_recv, 0, good[0].index(parse_action("0SEND_F1")), "0SEND_F1 has no matching 1RECV_F1")
    no_send = {0: [a for a in good[0] if str(a) != "0SEND_F1"], 1: good[1]}
    raises_at(no_send, 1, good[1].index(parse_action("1RECV_F1")), "1RECV_F1 has no matching 0SEND_F1")


def test_lowered_comm_without_peer() -> None:
    good = lower(parse_order(GOOD))
    extra = {0: good[0] + [parse_action("0SEND_B0")], 1: good[1]}
    raises_at(extra, 0, len(good[0]), "0SEND_B0 stage has no peer on another rank")


def test_lowered_send_before_its_producer() -> None:
    rows = {0: "0SEND_F0 0F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    raises_at(rows, 0, 0, "0SEND_F0 comes before the action that produces it", m=1)


def test_lowered_compute_before_its_recv() -> None:
    rows = {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1F0 1RECV_F0 1B0 1SEND_B0"}
    raises_at(rows, 1, 0, r"1F0 needs activations from stage 0 \(rank 0\) but its 1RECV_F0 comes only at step 1",
              m=1)
    rows = {0: "0F0 0SEND_F0 0B0 0RECV_B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    raises_at(rows, 0, 2, "0B0 needs output gradients from stage 1", m=1)


def test_not_an_action() -> None:
    order = parse_order(GOOD)
    order[1][0] = "1F0"  # type: ignore[list-item]
    with pytest.raises(ScheduleError, match="expected an Action or None") as info:
        validate(order, 2, 2)
    assert (info.value.rank, info.value.step) == (1, 0)


def test_error_message_names_location_and_prints_table() -> None:
    err = raises_at({0: "0F0 0F1 . 0B0 . 0B1", 1: ". 1B0 1F0 1F1 1B1"}, 1, 1, "before")
    text = str(err)
    first = text.splitlines()[0]
    assert first.startswith("rank 1, step 1, action 1B0:")
    assert "[1B0]" in text
    assert sum(line.startswith("rank ") for line in text.splitlines()[1:]) == 2


def test_error_pickles() -> None:
    err = raises_at({0: "0F0 0F1 . 0B0 . 0B1", 1: ". 1B0 1F0 1F1 1B1"}, 1, 1, "before")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rank, back.step, back.action, str(back)) == (err.rank, err.step, err.action, str(err))
    assert isinstance(back, ValueError)


def test_long_rows_are_windowed_around_the_mark() -> None:
    order = bfs_order(2, 1, 60)
    order[1][90], order[1][100] = order[1][100], order[1][90]  # 1B40 <-> 1B30, fine
    order[1][30], order[1][90] = order[1][90], order[1][30]  # 1F30 after 1B30
    with pytest.raises(ScheduleError) as info:
        validate(order, 2, 60)
    assert (info.value.rank, info.value.step, str(info.value.action)) == (1, 30, "1B40")
    table = str(info.value).split("\n", 1)[1]
    assert "…" in table and "[1B40]" in table
    assert max(len(line) for line in table.splitlines()) < 400


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        validate(parse_order(GOOD), 0, 2)


@pytest.mark.timeout(120)  # a guard against a blow-up, not a timing claim (a few seconds on a quiet core)
def test_p64_lower_and_validate_scale() -> None:
    p, v, m = 64, 2, 128
    order = bfs_order(p, v, m)
    validate(lower(order), p * v, m)
    validate(lower(split_backward(order)), p * v, m)
