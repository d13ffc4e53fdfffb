"""Lowering (comm insertion) and the I+W <-> B passes, on hand-written orders."""

from __future__ import annotations

import pytest

from pippy_split.schedule.actions import Action, ActionKind, Order, parse_action
from pippy_split.schedule.deps import chain_links
from pippy_split.schedule.lower import (
    Peers,
    infer_placement,
    lower,
    merge_backward,
    peer_table,
    peers,
    split_backward,
)
from pippy_split.schedule.placement import rank_to_stages, stage_to_rank
from pippy_split.schedule.validate import ScheduleError, validate

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def bfs_order(num_ranks: int, stages_per_rank: int, m: int, style: str = "loop") -> Order:
    """Each rank: all forwards of its stages (ascending), then all backwards (descending).

    Valid for any placement and any links with src < dst.
    """
    order: Order = {}
    for rank, stages in rank_to_stages(num_ranks * stages_per_rank, num_ranks, style).items():
        acts: list[Action | None] = [Action(s, F, mb) for s in stages for mb in range(m)]
        acts += [Action(s, B, mb) for s in reversed(stages) for mb in range(m)]
        order[rank] = acts
    return order


def texts(actions: list[Action | None]) -> list[str]:
    return [str(a) if a is not None else "" for a in actions]


def parse_order(rows: dict[int, str]) -> Order:
    return {r: [None if t == "." else parse_action(t) for t in row.split()] for r, row in rows.items()}


def channel_sequences(lowered: Order, links, placement) -> dict:
    """Per (sender rank, receiver rank): (messages as the sender posts them, as the receiver posts them)."""
    from pippy_split.schedule.messages import action_messages

    table = peer_table(1 + max(placement), links, placement)
    seqs: dict = {}
    for rank in sorted(lowered):
        for a in lowered[rank]:
            if a.kind.is_comm:
                for m in action_messages(a, table):
                    chan = (placement[m.sender], placement[m.receiver])
                    seqs.setdefault(chan, ([], []))[0 if a.is_send else 1].append(m)
    return seqs


def test_chain_loop_two_stages_per_rank_exact() -> None:
    # p=2, stages 0,2 on rank 0 and 1,3 on rank 1: every chain link crosses ranks.
    lowered = lower(bfs_order(2, 2, 2))
    assert texts(lowered[0]) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 "
        "2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 "
        "2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 "
        "0RECV_B0 0B0 0RECV_B1 0B1"
    ).split()
    # rank 1's receives are hoisted to the moment rank 0 sends (1RECV_F1 right after 1F0)
    assert texts(lowered[1])[:4] == ["1RECV_F0", "1F0", "1RECV_F1", "1SEND_F0"]
    validate(lowered, num_stages=4, n_microbatches=2)
    for sends, recvs in channel_sequences(lowered, chain_links(4), stage_to_rank(4, 2)).values():
        assert sends == recvs


def test_sends_right_after_producer_receives_before_consumer() -> None:
    order = split_backward(bfs_order(3, 2, 3))
    lowered = lower(order)
    for acts in lowered.values():
        seen: set = set()
        last_compute = None
        for a in acts:
            if a.kind.is_compute:
                seen.add((a.stage, a.kind, a.mb))
                last_compute = a
                if a.kind in (F, B, I):  # its remote inputs came in earlier on this rank
                    need = ActionKind.RECV_F if a.kind is F else ActionKind.RECV_B
                    if any(x.kind is need and (x.stage, x.mb) == (a.stage, a.mb) for x in acts):
                        assert ("recv", a.stage, a.mb, need) in seen, a
            elif a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                seen.add(("recv", a.stage, a.mb, a.kind))
            else:  # a SEND sits in the batch right after the action that produces it
                want = (F,) if a.kind is ActionKind.SEND_F else (B, I)
                assert (last_compute.stage, last_compute.mb) == (a.stage, a.mb) and last_compute.kind in want
    # compute actions keep their relative order
    for r in order:
        assert [a for a in lowered[r] if a.kind.is_compute] == [a for a in order[r] if a is not None]
    validate(lowered, num_stages=6, n_microbatches=3)


def test_idle_slots_are_dropped() -> None:
    order = {0: [Action(0, F, 0), None, None, Action(0, B, 0)], 1: [None, Action(1, F, 0), Action(1, B, 0)]}
    lowered = lower(order)
    assert texts(lowered[0]) == ["0F0", "0SEND_F0", "0RECV_B0", "0B0"]
    assert texts(lowered[1]) == ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]


def test_skip_links_loop_placement_one_send_per_stage_and_mb() -> None:
    # p=4 ranks, one stage each; 0->2 carries a gradient, 0->3 does not.
    links = chain_links(4) + [(0, 2, True), (0, 3, False)]
    table = peer_table(4, links, stage_to_rank(4, 4, "loop"))
    assert table[0] == Peers(recv_f=(), send_f=(1, 2, 3), recv_b=(1, 2), send_b=())
    assert table[2] == Peers(recv_f=(1, 0), send_f=(3,), recv_b=(3,), send_b=(1, 0))
    assert table[3] == Peers(recv_f=(2, 0), send_f=(), recv_b=(), send_b=(2,))
    lowered = lower(bfs_order(4, 1, 2), links=links)
    # one SEND per message, each naming its peer (stage 0 has three remote readers)
    assert [t for t in texts(lowered[0]) if t.startswith("0SEND_F0")] == ["0SEND_F0>1", "0SEND_F0>2", "0SEND_F0>3"]
    assert "0RECV_B0<1" in texts(lowered[0]) and "0RECV_B0<2" in texts(lowered[0])
    assert texts(lowered[3])[0] == "3RECV_F0<0"  # the skip arrives long before 3F0 needs it
    validate(lowered, 4, 2, links=links)
    for sends, recvs in channel_sequences(lowered, links, stage_to_rank(4, 4)).values():
        assert sends == recvs
    # Actions without a peer cover every remote peer, so the chain's lowering serves too.
    validate(lower(bfs_order(4, 1, 2)), 4, 2, links=links)


def test_lowered_without_a_skip_link_is_caught() -> None:
    # V, p=2: stages 1 and 2 share rank 1, so the chain gives stage 1 no SEND_F;
    # a skip link 1 -> 3 (rank 0) needs one.
    links = chain_links(4) + [(1, 3, True)]
    order = bfs_order(2, 2, 1, "v")
    with pytest.raises(ScheduleError, match="no matching 1SEND_F0"):
        validate(lower(order), 4, 1, links=links)
    lowered = lower(order, links=links)
    assert "1SEND_F0" in texts(lowered[1]) and "1RECV_B0" in texts(lowered[1])
    validate(lowered, 4, 1, links=links)


def test_skip_links_v_placement_and_same_rank_pairs() -> None:
    # p=4, 8 stages, V: rank 0 holds 0 and 7, rank 3 holds 3 and 4.
    placement = stage_to_rank(8, 4, "v")
    links = chain_links(8) + [(0, 7, True), (0, 3, True), (1, 5, False)]
    table = peer_table(8, links, placement)
    assert table[3].send_f == () and table[4].recv_f == ()  # 3 -> 4: same rank
    assert table[3].recv_b == () and table[4].send_b == ()
    assert 7 not in table[0].send_f and 0 not in table[7].send_b  # 0 -> 7: same rank
    assert 3 in table[0].send_f and 3 in table[0].recv_b and 0 in table[3].send_b
    assert table[5].recv_f == (4, 1) and table[5].send_b == (4,)  # 1 -> 5 is grad-free
    order = bfs_order(4, 2, 3, "v")
    lowered = lower(order, links=links, placement=placement)
    rank3 = texts(lowered[3])
    for banned in ("3SEND_F", "4RECV_F", "4SEND_B", "3RECV_B"):
        assert not any(t.startswith(banned) for t in rank3)
    assert [t for t in texts(lowered[0]) if t.startswith("0SEND_F")] == ["0SEND_F0>1", "0SEND_F0>3", "0SEND_F1>1",
                                                                          "0SEND_F1>3", "0SEND_F2>1", "0SEND_F2>3"]
    validate(lowered, 8, 3, links=links, placement=placement)
    validate(lowered, 8, 3, links=links, placement="v")


def test_chain_v_placement_same_rank_hand_off() -> None:
    lowered = lower(bfs_order(4, 2, 2, "v"))
    assert infer_placement(lowered) == stage_to_rank(8, 4, "v")
    assert [t for t in texts(lowered[3]) if "SEND" in t or "RECV" in t] == [
        "3RECV_F0", "3RECV_F1", "4SEND_F0", "4SEND_F1", "4RECV_B0", "4RECV_B1", "3SEND_B0", "3SEND_B1",
    ]
    validate(lowered, 8, 2)


def test_explicit_placement_overrides_inference() -> None:
    order = bfs_order(2, 1, 1)
    # Pretend both stages sit on rank 0 (as in a single-rank check): no comm at all.
    lowered = lower(order, placement={0: 0, 1: 0})
    assert all(a.kind.is_compute for acts in lowered.values() for a in acts)


def test_peers_single_stage() -> None:
    p = peers(1, chain_links(3), {0: 0, 1: 1, 2: 1})
    assert p == Peers(recv_f=(0,), send_f=(), recv_b=(), send_b=(0,))


def test_bad_links_and_double_lowering_raise() -> None:
    with pytest.raises(ValueError, match=r"no rank for stages \[2, 3, 4, 5\]"):
        lower(bfs_order(2, 1, 1), links=[(0, 5, True)])
    with pytest.raises(ValueError, match="outside"):
        validate(bfs_order(2, 1, 1), 2, 1, links=[(0, 5, True)])
    with pytest.raises(ValueError, match="compute-only"):
        lower(lower(bfs_order(2, 1, 1)))
    with pytest.raises(ValueError, match="rank 0 and rank 1"):
        infer_placement({0: [Action(0, F, 0)], 1: [Action(0, B, 0)]})


def test_merge_and_split_backward() -> None:
    order = parse_order({0: "0F0 0F1 0I0 0W0 0I1 . 0W1", 1: "1F0 1B0"})
    merged = merge_backward(order)
    assert texts(merged[0]) == ["0F0", "0F1", "0B0", "0I1", "", "0W1"]
    assert merged[1] == order[1]
    split = split_backward(merged)
    assert texts(split[0]) == ["0F0", "0F1", "0I0", "0W0", "0I1", "", "0W1"]
    assert texts(split[1]) == ["1F0", "1I0", "1W0"]
    big = bfs_order(3, 2, 4)
    assert merge_backward(split_backward(big)) == big
    # I and W of different microbatches are not merged
    assert texts(merge_backward(parse_order({0: "0I0 0W1"}))[0]) == ["0I0", "0W1"]
