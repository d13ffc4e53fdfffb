"""Order generators, dependency rules and the simulator, tested as pure functions.

Tier: pure (no process group, no torch). Every registered order family is
generated over a grid of (ranks, stages per rank, microbatches) and checked
for completeness, placement and ordering, then simulated; a few quality
figures (bubble, activation memory, speed) are pinned down with unit costs.

Run: python -m pytest tests/schedule/test_orders.py -q -p no:cacheprovider
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from pippy_split.schedule.actions import Action, ActionKind
from pippy_split.schedule.deps import chain_links, compute_deps, satisfies
from pippy_split.schedule.orders import ORDERS, OrderSpec, get_order_spec
from pippy_split.schedule.orders.interleaved_1f1b import microbatch_groups
from pippy_split.schedule.placement import stage_to_rank
from pippy_split.schedule.simulate import Simulation, simulate

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
RANKS = (1, 2, 3, 4, 5, 8)


def _microbatch_counts(p: int) -> list[int]:
    return sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1} - {0})


def _stage_counts(spec: OrderSpec) -> list[int]:
    if spec.stages_per_rank is not None:
        return [spec.stages_per_rank]
    return [spec.min_stages_per_rank, spec.min_stages_per_rank + 1, 4]


def _grid() -> list[tuple[str, int, int, int]]:
    return [
        (name, p, v, m)
        for name, spec in ORDERS.items()
        for p in RANKS
        for v in _stage_counts(spec)
        for m in _microbatch_counts(p)
    ]


def _required_error(name: str, p: int, m: int) -> bool:
    """Sizes a family documents it cannot do (the generator must say so)."""
    return name == "DualPipeV" and m < 2 * p - 1


def check_order(spec: OrderSpec, p: int, v: int, m: int) -> None:
    """Completeness, placement and local ordering of one generated order."""
    order = spec.compute_order(p, m, v)
    num_stages = p * v
    where = stage_to_rank(num_stages, p, spec.placement)
    assert sorted(order) == list(range(p))
    seen: Counter[tuple[int, ActionKind, int]] = Counter()
    position: dict[tuple[int, ActionKind, int], tuple[int, int]] = {}
    for rank, actions in order.items():
        for step, a in enumerate(actions):
            if a is None:
                continue
            assert a.kind.is_compute, f"{spec.name}: rank {rank} step {step} holds comm action {a}"
            assert where[a.stage] == rank, f"{spec.name}: stage {a.stage} on rank {rank}, not {where[a.stage]}"
            assert 0 <= a.mb < m, f"{spec.name}: {a} has mb out of range"
            seen[(a.stage, a.kind, a.mb)] += 1
            position[(a.stage, a.kind, a.mb)] = (rank, step)
    for s in range(num_stages):
        for mb in range(m):
            assert seen[(s, F, mb)] == 1, f"{spec.name}: stage {s} mb {mb} has {seen[(s, F, mb)]} forwards"
            full, split = seen[(s, B, mb)], (seen[(s, I, mb)], seen[(s, W, mb)])
            assert (full, split) in ((1, (0, 0)), (0, (1, 1))), f"{spec.name}: stage {s} mb {mb}: B={full} I,W={split}"
            bwd = (s, B, mb) if full else (s, I, mb)
            assert position[(s, F, mb)][1] < position[bwd][1], f"{spec.name}: backward of {s}/{mb} before its forward"
            if not full:
                assert position[bwd][1] < position[(s, W, mb)][1], f"{spec.name}: W of {s}/{mb} before its I"
    uses_split = any(k[1] in (I, W) for k in seen)
    assert uses_split == spec.split_backward, f"{spec.name}: split_backward flag says {spec.split_backward}"
    sim = simulate(order)
    busy = {"F": 1, "B": 2, "I": 1, "W": 1}
    assert sim.makespan >= sum(busy[k[1].value] for k in seen) / p  # no rank can beat its own work


@pytest.mark.parametrize("name,p,v,m", _grid())
def test_order_is_complete_placed_and_runs(name: str, p: int, v: int, m: int) -> None:
    spec = ORDERS[name]
    if _required_error(name, p, m):
        with pytest.raises(ValueError, match="n_microbatches"):
            spec.compute_order(p, m, v)
        return
    check_order(spec, p, v, m)


@pytest.mark.parametrize("name", list(ORDERS))
def test_orders_pass_the_validator(name: str) -> None:
    from pippy_split.schedule.validate import validate

    spec = ORDERS[name]
    for p, m in ((2, 4), (4, 9), (3, 12)):
        v = spec.default_stages_per_rank()
        validate(spec.compute_order(p, m, v), num_stages=p * v, n_microbatches=m, placement=spec.placement)


@pytest.mark.parametrize("name", list(ORDERS))
def test_wrong_stage_count_is_refused_clearly(name: str) -> None:
    spec = ORDERS[name]
    bad = spec.stages_per_rank + 1 if spec.stages_per_rank is not None else spec.min_stages_per_rank - 1
    if bad < 1:
        pytest.skip(f"{name} accepts any stages_per_rank >= 1")
    with pytest.raises(ValueError, match="stages"):
        spec.compute_order(4, 8, bad)


# -- registry -----------------------------------------------------------------


def test_registry_names_and_lookup() -> None:
    assert list(ORDERS) == [
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    ]
    assert get_order_spec("zbvzerobubble") is ORDERS["ZBVZeroBubble"]
    assert get_order_spec("1f1b").placement == "loop"
    with pytest.raises(ValueError, match="GPipe, 1F1B, Interleaved1F1B"):
        get_order_spec("PipeDream")
    for spec in ORDERS.values():
        assert spec.paper and spec.compute_order.__module__.startswith("pippy_split.schedule.orders.")
        with pytest.raises(AttributeError):
            spec.name = "x"  # type: ignore[misc]  # frozen


# -- quality with unit costs ------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("mult", [0.5, 1, 2, 4])
def test_1f1b_bubble_is_the_textbook_value(p: int, mult: float) -> None:
    m = max(1, int(p * mult))
    sim = simulate(get_order_spec("1F1B").compute_order(p, m))
    assert math.isclose(sim.bubble_fraction, (p - 1) / (m + p - 1), rel_tol=1e-12, abs_tol=1e-12)
    assert sim.makespan == 3 * (m + p - 1)


def test_zbv_bubble_is_under_half_of_1f1b() -> None:
    zbv = simulate(get_order_spec("ZBVZeroBubble").compute_order(4, 16, 2))
    one = simulate(get_order_spec("1F1B").compute_order(4, 16))
    assert zbv.bubble_fraction < 0.5 * one.bubble_fraction
    assert max(zbv.peak_activations.values()) <= 2 * 4  # 1F1B's memory in half-size stages


def test_zero_bubble_beats_1f1b_and_keeps_its_memory() -> None:
    zb = simulate(get_order_spec("InterleavedZeroBubble").compute_order(4, 16, 1))
    one = simulate(get_order_spec("1F1B").compute_order(4, 16))
    assert zb.makespan < one.makespan
    assert zb.bubble_fraction < 0.5 * one.bubble_fraction
    assert max(zb.peak_activations.values()) <= 4


def test_interleaving_shrinks_the_bubble() -> None:
    one = simulate(get_order_spec("1F1B").compute_order(4, 8))
    il = simulate(get_order_spec("Interleaved1F1B").compute_order(4, 8, 2))
    assert il.bubble_fraction < one.bubble_fraction


def test_activation_memory_of_gpipe_and_1f1b() -> None:
    p, m = 4, 12
    one = simulate(get_order_spec("1F1B").compute_order(p, m))
    gpipe = simulate(get_order_spec("GPipe").compute_order(p, m))
    assert one.peak_activations[0] <= p
    assert one.peak_activations == {r: p - r for r in range(p)}
    assert gpipe.peak_activations[0] == m


def test_interleaved_groups_are_wide_enough() -> None:
    assert [list(g) for g in microbatch_groups(9, 4)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [len(g) for g in microbatch_groups(3, 4)] == [3]
    assert all(len(g) >= 4 for g in microbatch_groups(23, 4))


# -- scale (how long it takes is benchmarks/plan_scale.py's to measure, never a test's) ----


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n, s in ORDERS.items() if s.stages_per_rank in (None, 2)])
def test_large_pipeline_generates_and_simulates(name: str) -> None:
    order = get_order_spec(name).compute_order(64, 256, 2)
    sim = simulate(order)
    assert sim.num_ranks == 64
    # each rank computes F, then B (or I and W) for its 2 stages x 256 microbatches: 3 units each
    assert sim.makespan >= 3 * 256 * 2
    assert 0 < sim.bubble_fraction < 1


@pytest.mark.timeout(120)
def test_simulate_1024_ranks() -> None:
    p, m = 1024, 32
    sim = simulate(get_order_spec("1F1B").compute_order(p, m))
    assert sim.makespan == 3 * (m + p - 1)


# -- dependency rules ------------------------------------------------------------------


def test_chain_dependencies() -> None:
    links = chain_links(4)
    assert compute_deps(Action(2, F, 5), links, 4) == [Action(1, F, 5)]
    assert compute_deps(Action(0, F, 0), links, 4) == []
    assert compute_deps(Action(3, B, 1), links, 4) == [Action(3, F, 1)]  # last stage: own F only
    assert compute_deps(Action(1, I, 1), links, 4) == [Action(1, F, 1), Action(2, I, 1)]
    assert compute_deps(Action(1, W, 1), links, 4) == [Action(1, I, 1)]
    assert satisfies(Action(2, B, 1), Action(2, I, 1)) and not satisfies(Action(2, W, 1), Action(2, I, 1))


def test_skip_link_dependencies() -> None:
    # 0 -> 1 -> 2 plus a skip 0 -> 2; the skip carries a gradient, a 1 -> 2 side input does not.
    links = [(0, 1, True), (1, 2, False), (0, 2, True)]
    assert set(compute_deps(Action(2, F, 0), links, 3)) == {Action(1, F, 0), Action(0, F, 0)}
    assert compute_deps(Action(0, B, 0), links, 3) == [Action(0, F, 0), Action(1, I, 0), Action(2, I, 0)]
    assert compute_deps(Action(1, B, 0), links, 3) == [Action(1, F, 0)]
    with pytest.raises(ValueError, match="outside"):
        compute_deps(Action(5, F, 0), links, 3)


# -- simulator ---------------------------------------------------------------------------


def _order(rows: dict[int, str]) -> dict[int, list[Action | None]]:
    from pippy_split.schedule.actions import parse_action

    return {r: [None if c == "-" else parse_action(c) for c in text.split()] for r, text in rows.items()}


def test_simulate_costs_idle_steps_and_b_equals_i_plus_w() -> None:
    order = _order({0: "0F0 - 0B0", 1: "1F0 1B0"})
    sim = simulate(order, {"F": 2, "I": 3, "W": 1})
    assert isinstance(sim, Simulation)
    # 0F0 [0,2) 1F0 [2,4) 1B0 [4,8) 0B0 [8,12); the None step costs nothing.
    assert sim.makespan == 12
    assert [(s, e, str(a)) for s, e, a in sim.timeline[0]] == [(0, 2, "0F0"), (8, 12, "0B0")]
    assert sim.bubble_fraction == pytest.approx(1 - (6 + 6) / (2 * 12))
    assert sim.peak_activations == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="unknown cost keys"):
        simulate(order, {"X": 1})


def test_simulate_comm_latency_only_across_ranks() -> None:
    order = _order({0: "0F0 1F0 1B0 0B0"})  # both stages on one rank: no hop
    assert simulate(order, comm_latency=5).makespan == 6
    order = _order({0: "0F0 0B0", 1: "1F0 1B0"})
    assert simulate(order, comm_latency=5).makespan == 6 + 2 * 5


def test_simulate_reports_deadlock_with_rank_and_action() -> None:
    order = _order({0: "0B0 0F0", 1: "1F0 1B0"})
    with pytest.raises(ValueError, match=r"rank 0 step 0 \(0B0\) waits for 0F0"):
        simulate(order)


def test_simulate_lowered_order_waits_for_sends() -> None:
    order = _order({0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})
    assert simulate(order).makespan == simulate(_order({0: "0F0 0B0", 1: "1F0 1B0"})).makespan
    missing_send = _order({0: "0F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})
    with pytest.raises(ValueError, match="waits for 0SEND_F0"):
        simulate(missing_send)


def test_simulate_lowered_generated_orders_close_to_compute_only() -> None:
    """Under NCCL's batch rule a send batch holds the rank's next batch until the peer posts
    its receive, so a lowered order may take a little longer than its compute-only ideal."""
    from pippy_split.schedule.lower import lower

    for name, spec in ORDERS.items():
        order = spec.compute_order(4, 8, spec.default_stages_per_rank())
        ideal, lowered = simulate(order).makespan, simulate(lower(order)).makespan
        assert ideal <= lowered <= 1.1 * ideal, (name, ideal, lowered)


def test_simulation_renders_through_render_module() -> None:
    sim = simulate(get_order_spec("1F1B").compute_order(2, 3))
    assert "rank" in str(sim).lower() or "0" in str(sim)
    assert sim.to_svg().lstrip().startswith("<")
    assert sim._repr_html_()


@pytest.mark.parametrize("name", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_orders_stay_ahead_with_uneven_costs(name: str) -> None:
    # Orders are static; they must keep their edge when I and W are not 1 each.
    spec = get_order_spec(name)
    for costs, latency in (({"F": 1, "I": 1.5, "W": 0.5}, 0.25), ({"F": 1, "I": 2, "W": 1}, 0.5)):
        zb = simulate(spec.compute_order(4, 16, spec.default_stages_per_rank()), costs, comm_latency=latency)
        one = simulate(get_order_spec("1F1B").compute_order(4, 16), costs, comm_latency=latency)
        # Per rank, a zero-bubble order does the same work in v half-size stages.
        assert zb.bubble_fraction < one.bubble_fraction, (name, costs)
