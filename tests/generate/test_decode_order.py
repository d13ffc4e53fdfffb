"""Decode orders as data: built, lowered, validated under NCCL's batch rule and simulated over
a grid of sizes and both placements, with no process group."""

from __future__ import annotations

import pytest

from pippy_split.schedule.actions import Action, ActionKind, parse_action
from pippy_split.schedule.decode_order import (
    DecodeOrderError,
    decode_order,
    lower_decode,
    simulate_decode,
    validate_decode,
)
from pippy_split.schedule.placement import stage_to_rank


@pytest.mark.parametrize("style", ["loop", "v"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("per_rank", [1, 2])
@pytest.mark.parametrize("lanes", [1, 2, 3, 5])
@pytest.mark.parametrize("rounds", [1, 4])
def test_orders_validate(style: str, ranks: int, per_rank: int, lanes: int, rounds: int) -> None:
    if style == "v" and per_rank != 2:
        pytest.skip("V placement holds two stages per rank")
    n = ranks * per_rank
    placement = stage_to_rank(n, ranks, style)
    links = {s: {s - 1} for s in range(1, n)}
    if n > 2:
        links[n - 1].add(0)  # a skip edge: the last stage reads stage 0's value too
    readers = {0} if n < 3 else {0, 2}  # a later stage reading input_ids too
    order = decode_order(placement, lanes=lanes, rounds=rounds)
    lowered = lower_decode(order, placement, links=links, token_readers=readers)
    validate_decode(lowered, placement, lanes=lanes, rounds=rounds)
    sim = simulate_decode(lowered)
    assert sim.makespan >= lanes * rounds * per_rank
    assert 0 <= sim.bubble_fraction < 1


def test_lanes_fill_the_pipeline() -> None:
    """With as many lanes as stages, every rank is busy nearly all the time."""
    placement = stage_to_rank(4, 4, "loop")
    links = {s: {s - 1} for s in range(1, 4)}
    busy = {}
    for lanes in (1, 4):
        order = decode_order(placement, lanes=lanes, rounds=16)
        busy[lanes] = simulate_decode(lower_decode(order, placement, links=links, token_readers={0}))
    assert busy[1].bubble_fraction > 0.7  # one lane: each rank works one tick in four
    assert busy[4].bubble_fraction < 0.1


def test_a_wrong_order_is_refused() -> None:
    placement = {0: 0, 1: 1}
    order = decode_order(placement, lanes=2, rounds=1)
    lowered = lower_decode(order, placement, links={1: {0}}, token_readers={0})
    swapped = {0: lowered[0], 1: [lowered[1][2], lowered[1][3], lowered[1][0], lowered[1][1]]}
    with pytest.raises(DecodeOrderError, match="another order"):
        validate_decode(swapped, placement, lanes=2, rounds=1)
    with pytest.raises(DecodeOrderError, match="missing"):
        validate_decode({0: lowered[0][:1], 1: []}, placement, lanes=2, rounds=1)
    send = Action(0, ActionKind.SEND_D, 1, peer=1, round=2)
    assert str(send) == "0SEND_D1.2>1" and parse_action(str(send)) == send


def test_decode_actions_are_actions_of_the_one_ir() -> None:
    """Decode actions print, parse and batch as training actions do; only they carry a round,
    and a decode message names its peer."""
    for text in ("2D1.4", "0SEND_T3.1>2", "1RECV_D0.0<0"):
        assert str(parse_action(text)) == text and parse_action(text).round is not None
    with pytest.raises(ValueError, match="round"):
        Action(0, ActionKind.F, 0, round=1)
    with pytest.raises(ValueError, match="round"):
        Action(0, ActionKind.D, 0)
    with pytest.raises(ValueError, match="names its peer"):
        Action(0, ActionKind.SEND_D, 0, round=0)


def test_a_deadlocking_order_is_refused_by_the_shared_batch_loop() -> None:
    """Both ranks receive before they send: the batch rule's event loop (the one training
    orders are checked with) finds no rank can move."""
    placement = {0: 0, 1: 1}
    lowered = lower_decode(decode_order(placement, lanes=1, rounds=2), placement, links={1: {0}}, token_readers={0})
    stuck = {0: [parse_action("0RECV_T0.1<1"), *[a for a in lowered[0] if a.kind is not ActionKind.RECV_T]],
             1: lowered[1]}
    with pytest.raises(DecodeOrderError, match="deadlocks"):
        validate_decode(stuck, placement, lanes=1, rounds=2)


def test_ps_simulate_takes_a_decode_order() -> None:
    """``ps.simulate`` of a lowered decode order gives its bubble (the same run as simulate_decode)."""
    import pippy_split as ps

    placement = stage_to_rank(4, 2, "v")
    links = {s: {s - 1} for s in range(1, 4)}
    for lanes in (1, 2):
        lowered = lower_decode(decode_order(placement, lanes=lanes, rounds=6), placement, links=links,
                               token_readers={0, 1})
        sim = ps.simulate(lowered, {"D": 3.0})
        assert sim.bubble_fraction == simulate_decode(lowered, 3.0).bubble_fraction
        assert sim.makespan >= 3.0 * lanes * 6 * 2
    assert ps.simulate(lowered).bubble_fraction < 0.5 <= ps.simulate(
        lower_decode(decode_order(placement, lanes=1, rounds=6), placement, links=links, token_readers={0, 1})
    ).bubble_fraction
