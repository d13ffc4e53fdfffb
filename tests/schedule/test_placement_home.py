"""Placement has one home (pippy_split.schedule.placement): orders state theirs as data,
and every reader of an order's placement uses the same rule."""

from __future__ import annotations

import pytest

from pippy_split.schedule import get_schedule_class
from pippy_split.schedule.actions import parse_action
from pippy_split.schedule.orders import ORDERS
from pippy_split.schedule.placement import (PlacementConflict, local_stages, placement_of_order, replace_placement,
                                            resolve_placement, stage_to_rank)


@pytest.mark.parametrize("name", list(ORDERS))
def test_every_family_states_its_placement_and_its_orders_follow_it(name: str) -> None:
    spec = ORDERS[name]
    v = spec.default_stages_per_rank()
    for p in (1, 2, 3):
        order = spec.compute_order(p, 2 * p, v)
        assert placement_of_order(order) == stage_to_rank(p * v, p, spec.placement)
        assert get_schedule_class(name).stage_placement(p * v, p) == spec.stage_placement(p * v, p)


def test_placement_of_order_names_the_second_rank_of_a_stage() -> None:
    order = {0: [parse_action("0F0")], 1: [None, parse_action("0B0")]}
    with pytest.raises(PlacementConflict, match="rank 0 and rank 1") as info:
        placement_of_order(order)
    assert (info.value.stage, info.value.home, info.value.rank, info.value.step) == (0, 0, 1, 1)


def test_resolve_and_replace() -> None:
    assert resolve_placement(None, 2, 2, {0: [parse_action("1F0")], 1: [parse_action("0F0")]}) == {1: 0, 0: 1}
    assert resolve_placement({0: 1, 1: 0}, 2, 2) == {0: 1, 1: 0}
    with pytest.raises(ValueError, match="needs the order"):
        resolve_placement(None, 2, 2)
    assert local_stages(2, 2, "loop") == {0: [0, 2], 1: [1, 3]}
    moved = replace_placement({0: [parse_action("2F0")], 1: [parse_action("3F0")]}, 4, 2, "loop", "v")
    assert [str(a) for a in moved[0] + moved[1]] == ["3F0", "2F0"]
    with pytest.raises(ValueError, match="different numbers of stages"):
        replace_placement({0: [], 1: []}, 4, 2, "loop", {0: 0, 1: 0, 2: 0, 3: 1})
