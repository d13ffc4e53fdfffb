"""NCCL's rules on lowered orders: the family grid and random orders all come out safe,
and the validator catches the unsafe patterns the previous lowering produced."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.order_safety import unsafe_orders
from pippy_split.schedule.actions import Action, ActionKind, parse_action
from pippy_split.schedule.deps import DepIndex, chain_links
from pippy_split.schedule.lower import lower
from pippy_split.schedule.simulate import simulate
from pippy_split.schedule.validate import ScheduleError, validate

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def test_every_family_on_the_grid_is_safe() -> None:
    bad, total = unsafe_orders()
    assert total > 200
    assert bad == []


def _rows(rows: dict[int, str]):
    return {r: [parse_action(t) for t in row.split()] for r, row in rows.items()}


def test_swapped_messages_on_a_channel_are_named() -> None:
    # ZBV p=2 style: rank 0 sends stage 0's mb 1 activations before stage 3's mb 0 gradient,
    # rank 1 receives them the other way round: same shapes on NCCL, silently swapped.
    links = chain_links(4)
    rows = {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 3RECV_F1 3F1 3B1 3SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1",
        1: "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2B0 1B0 1SEND_B0 1RECV_F1 1F1 2F1 2SEND_F1 2RECV_B1 2B1 1B1 1SEND_B1",
    }
    order = _rows(rows)
    with pytest.raises(ScheduleError, match=r"rank 0 -> rank 1: message 1 on this channel differs") as info:
        validate(order, 4, 2, links=links, placement="v")
    text = str(info.value)
    assert "0SEND_F1" in text and "2RECV_B0" in text and info.value.rank == 1


def test_a_send_held_until_its_receive_deadlocks() -> None:
    # gloo (sends never block) would run this; on NCCL rank 0's batch [0SEND_F1] holds until
    # rank 1 posts 1RECV_F1, which comes after rank 1's [1SEND_B0] (and 1W0), which waits for 0RECV_B0,
    # which rank 0 posts only after 0F2.
    rows = {0: "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0RECV_B0 0SEND_F2 0B0 0RECV_B1 0B1 0RECV_B2 0B2",
            1: "1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1 1RECV_F2 1F2 1I2 1SEND_B2 1W2"}
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(_rows(rows), 2, 3)
    assert "rank 0 at step 3 (0SEND_F1) waits for 1RECV_F1 from rank 1" in str(info.value)
    # posting the receive in the same batch as the send fixes it
    rows[0] = "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2"
    validate(_rows(rows), 2, 3)


def _random_case(rng: random.Random):
    """A random pipeline (placement, skip links) and a random compute order that can run:
    a random topological order of all compute actions, split by rank."""
    num_ranks = rng.randint(2, 4)
    num_stages = rng.randint(num_ranks, 3 * num_ranks)
    placement = {s: (s if s < num_ranks else rng.randrange(num_ranks)) for s in range(num_stages)}
    links = chain_links(num_stages)
    for _ in range(rng.randint(0, 3)):
        src = rng.randrange(num_stages - 1)
        dst = rng.randrange(src + 1, num_stages)
        if (src, dst) not in {(s, d) for s, d, _ in links}:
            links.append((src, dst, rng.random() < 0.5))
    m = rng.randint(1, 4)
    split = rng.random() < 0.5
    index = DepIndex(links, num_stages)
    todo = [(s, k, mb) for s in range(num_stages) for mb in range(m) for k in ((F, I, W) if split else (F, B))]
    done: set = set()
    order: dict[int, list] = {r: [] for r in range(num_ranks)}
    while todo:
        ready = [t for t in todo if all((ds, dk, dmb) in done or (dk is I and (ds, B, dmb) in done)
                                        for ds, dk, dmb in index.keys(*t))]
        s, k, mb = ready[rng.randrange(len(ready))]
        todo.remove((s, k, mb))
        done.add((s, k, mb))
        order[placement[s]].append(Action(s, k, mb))
    return order, links, placement, num_stages, m


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_runnable_orders_lower_to_safe_orders(seed: int) -> None:
    order, links, placement, num_stages, m = _random_case(random.Random(seed))
    lowered = lower(order, links, placement)
    validate(lowered, num_stages, m, links=links, placement=placement)
    simulate(lowered, links=links)  # the batch rule finishes too
    for r in order:  # compute actions keep their order; nothing crosses between same-rank stages
        assert [a for a in lowered[r] if a.kind.is_compute] == order[r]
        for a in lowered[r]:
            if a.kind.is_comm and a.peer is not None:
                assert placement[a.peer] != r
