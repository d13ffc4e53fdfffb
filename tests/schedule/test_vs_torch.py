"""Our orders against torch.distributed.pipelining's, on our simulator.

Tier: pure (no process group). The peer is imported here only (the library
never imports it). Its schedule classes compute ``pipeline_order`` in their
constructors from a few stage attributes, so light stand-in stage objects are
enough: no process group and no real modules are built. Each peer order is
converted to our :class:`Action` IR and both are simulated, with unit costs
(F = I = W = 1, B = 2) and with uneven costs plus a hop latency; ours must
finish no later.

Run: python -m pytest tests/schedule/test_vs_torch.py -q -p no:cacheprovider
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pippy_split.schedule.actions import Action, ActionKind, Order
from pippy_split.schedule.orders import ORDERS
from pippy_split.schedule.placement import rank_to_stages
from pippy_split.schedule.simulate import simulate

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

COMPUTE = {"F", "B", "I", "W"}
CASES = [(name, p, m) for name in ORDERS for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
# Unit costs, and uneven ones with a hop latency: a static order tuned only to
# unit costs can lose badly once real costs differ.
COSTS = {
    "unit": ({"F": 1, "I": 1, "W": 1}, 0.0),
    "uneven": ({"F": 1, "I": 1.5, "W": 0.5}, 0.25),
}


def _stand_in_stage(stage: int, num_stages: int, num_ranks: int) -> SimpleNamespace:
    """What the peer's schedule constructors read from a stage, and nothing more."""
    return SimpleNamespace(
        stage_index=stage,
        num_stages=num_stages,
        group_size=num_ranks,
        group_rank=0,
        is_first=stage == 0,
        is_last=stage == num_stages - 1,
        stage_index_to_group_rank=None,
        submod=None,
    )


def _to_ours(peer_order: dict) -> Order:
    """Peer ``_Action``s to ours: overlapped F&B pairs run forward first; REDUCE_GRAD etc. dropped."""
    order: Order = {}
    for rank, actions in peer_order.items():
        row: list[Action | None] = []
        for a in actions:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                kind = sub.computation_type.value
                if kind in COMPUTE:
                    row.append(Action(sub.stage_index, ActionKind(kind), sub.microbatch_index))
        order[rank] = row
    return order


def peer_order(name: str, num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Order:
    """The peer's compute order for the schedule of the same name."""
    cls = schedules.get_schedule_class(name)
    num_stages = num_ranks * stages_per_rank
    local = rank_to_stages(num_stages, num_ranks, ORDERS[name].placement)[0]
    stages = [_stand_in_stage(s, num_stages, num_ranks) for s in local]
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the peer logs a warning per bubble it pads
    try:
        if issubclass(cls, schedules.PipelineScheduleSingle):
            sched = cls(stages[0], n_microbatches)
        else:
            sched = cls(stages, n_microbatches)
    finally:
        logging.disable(previous)
    if sched.pipeline_order is None:
        raise ValueError(f"peer {cls.__name__} exposes no pipeline_order")
    return _to_ours(sched.pipeline_order)


def _complete(order: Order, num_stages: int, m: int) -> str | None:
    """Why ``order`` is not one forward per (stage, mb) in range, or None."""
    forwards = sorted((a.stage, a.mb) for acts in order.values() for a in acts if a and a.kind is ActionKind.F)
    expected = [(s, mb) for s in range(num_stages) for mb in range(m)]
    if forwards != expected:
        extra = sorted(set(forwards) - set(expected))[:3]
        return f"forwards are not one per (stage, mb); e.g. out of range: {extra}"
    return None


@pytest.mark.parametrize("costs", list(COSTS))
@pytest.mark.parametrize("name,p,m", CASES)
def test_ours_finish_no_later_than_the_peer(name: str, p: int, m: int, costs: str) -> None:
    cost, latency = COSTS[costs]
    spec = ORDERS[name]
    # Fixed counts as they are; the multi-stage families of either count at 2 per rank.
    v = spec.stages_per_rank if spec.stages_per_rank is not None else max(spec.min_stages_per_rank, 2)
    try:
        theirs = peer_order(name, p, m, v)
    except (ValueError, RuntimeError) as err:
        pytest.skip(f"peer {name} refuses p={p} m={m}: {err}")
    broken = _complete(theirs, p * v, m)
    if broken:
        pytest.skip(f"peer {name} order for p={p} m={m} is not a complete schedule: {broken}")
    try:
        their_sim = simulate(theirs, cost, comm_latency=latency)
    except ValueError as err:
        pytest.skip(f"peer {name} order for p={p} m={m} cannot run: {err}")
    ours = simulate(spec.compute_order(p, m, v), cost, comm_latency=latency)
    assert ours.makespan <= their_sim.makespan, (
        f"{name} p={p} m={m} v={v} {costs}: ours {ours.makespan} > peer {their_sim.makespan}"
    )
