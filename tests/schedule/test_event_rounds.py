"""simulate() in rounds over tensors (event_rounds, used for big orders) gives the same
numbers as the sequential event loop: every family, costs per kind and per stage,
latency, microbatch scale, activation bytes, deadlocks and repeated keys."""

from __future__ import annotations

import random

import pytest

from pippy_split.schedule import event_rounds, simulate
from pippy_split.schedule.actions import Action, ActionKind
from pippy_split.schedule.orders import ORDERS, get_order_spec
from pippy_split.schedule.orders.common import actions_of


def _both(monkeypatch, order, **kw):
    out = []
    for limit in (10**9, 0):  # sequential loop, then rounds
        monkeypatch.setattr(event_rounds, "MIN_RANKS", limit)
        monkeypatch.setattr(event_rounds, "MIN_ACTIONS", limit)
        try:
            sim = simulate(order, **kw)
            out.append((sim.makespan, sim.bubble_fraction, sim.peak_activations, sim.peak_bytes, sim.timeline))
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_rounds_equal_sequential(monkeypatch, name):
    spec = get_order_spec(name)
    rng = random.Random(0)
    for p, m in [(1, 3), (2, 4), (3, 5), (4, 8)]:
        try:
            order = spec.compute_order(p, m, spec.default_stages_per_rank())
        except ValueError:
            continue
        S = p * spec.default_stages_per_rank()
        for costs in (None, {"F": 1.3, "I": 0.7, "W": 0.45}, {(0, "F"): 2.5, "B": 1.9}):
            for lat in (0.0, 0.31):
                scale = [rng.uniform(0.5, 2.0) for _ in range(m)]
                a, b = _both(monkeypatch, order, costs=costs, comm_latency=lat, microbatch_scale=scale,
                             activation_bytes=[1.5] * S)
                assert a == b


def test_deadlock_and_repeats_read_the_same(monkeypatch):
    order = get_order_spec("1F1B").compute_order(3, 4)
    order[1] = list(reversed(order[1]))
    a, b = _both(monkeypatch, order)
    assert isinstance(a, str) and a == b and "deadlocks" in a
    order = get_order_spec("1F1B").compute_order(3, 4)
    order[1] = order[1] + [order[1][0]]  # a key written twice: rounds hand over to the loop
    a, b = _both(monkeypatch, order)
    assert a == b


def test_actions_of_equals_constructor():
    F, B = ActionKind.F, ActionKind.B
    built = actions_of([0, 3], [F, B], [5, 0], 2)
    assert built == [Action(0, F, 5), Action(3, B, 0)]
    assert [repr(a) for a in built] == ["Action(0F5)", "Action(3B0)"] and hash(built[0]) == hash(Action(0, F, 5))


def test_idle_steps_empty_rank_and_per_link_latency_read_the_same(monkeypatch):
    """Rounds lay each rank's actions out with a sentinel after them: idle steps, a rank
    with nothing to run and latencies that differ per link must not shift a position."""
    order = get_order_spec("1F1B").compute_order(4, 6)
    order[1] = [None, *order[1][:3], None, *order[1][3:]]
    order[7] = []  # a rank with no actions
    lat = {(0, 1): 0.25, (1, 2): 0.5, (2, 3): 1.75}
    a, b = _both(monkeypatch, order, costs={"F": 1.1, "B": 2.3}, comm_latency=lat, microbatch_scale=[1, 2, 1, 3, 1, 1])
    assert a == b and not isinstance(a, str)


def test_a_negative_cost_is_left_to_the_loop(monkeypatch):
    """``inf`` marks "not done" in rounds and zero slots pad the requirements, so a
    negative time goes to the sequential loop, which gives its own answer."""
    order = get_order_spec("1F1B").compute_order(3, 4)
    a, b = _both(monkeypatch, order, costs={"F": -1.0})
    assert a == b
