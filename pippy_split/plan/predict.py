"""One candidate's prediction: its family's order simulated with its split's costs.

Per candidate (:func:`predict_candidate`): the family's order for ``(ranks, m, stages per rank)``
is simulated (:func:`~pippy_split.schedule.simulate`) with each stage's F/I/W time at the
candidate's microbatch size (the split's measured actions where :mod:`.measure` ran it,
else the sums of its profiled ops; under checkpointing the backward also re-runs the
forward; an unsplit backward ``B`` costs ``I + W``), each cross-rank link's
``CommModel.time(bytes)``, and each stage's held bytes; a rank's predicted peak is its
parameters, gradients and optimizer state plus the simulated peak of held activations
(and, under checkpointing, one stage's rebuilt activations).

Sits between the priced split (:mod:`.costs`) and the search (:mod:`.search` calls it for
every candidate, and again for the contenders once measured); its result is a
:class:`~.candidate.Candidate`.
"""

from __future__ import annotations

import functools
from typing import Any

from ..schedule.actions import Order
from ..schedule.orders import get_order_spec
from ..schedule.placement import placement_of_order
from ..schedule.simulate import Simulation, simulate
from .candidate import Candidate
from .costs import CommModel, SplitCosts

__all__ = ["predict_candidate"]


def predict_candidate(costs: SplitCosts, schedule: str, num_ranks: int, m: int, ac: bool, scale: float, comm: CommModel,
             optimizer_state: float, budget: float, *, saved_only: bool = False) -> Candidate | None:
    """Simulate one candidate; ``None`` when the family cannot run these sizes.

    Action times are the split's measured stage actions (``costs.measured``, see
    :mod:`.measure`) where it has them, else the sums of its profiled ops.
    ``saved_only=True`` predicts only what autograd saves (what
    :class:`~.saved_bytes.SavedBytes` counts): without the output gradients a split
    backward keeps from I until W, nor a checkpointed stage's kept inputs.

    Example:
        >>> from pippy_split.plan.costs import StageCosts
        >>> stage = StageCosts(forward=1.0, input_grad=1.0, weight_grad=1.0, overhead=(0.0, 0.0, 0.0),
        ...                    held_bytes=100.0, boundary_bytes=10.0, param_bytes=50.0)  # seconds, bytes
        >>> costs = SplitCosts(None, "time", [stage, stage], {(0, 1): 0.0})  # two stages (no pipe: not run)
        >>> cand = predict_candidate(costs, "1F1B", 2, 4, False, 1.0, CommModel(latency=0.0), 2.0, 1e9)
        >>> cand.step_time, cand.peak_bytes  # 4 microbatches; 4 x 50 bytes: weights, grads, Adam's two
        (15.0, {0: 400.0, 1: 300.0})
    """
    spec = get_order_spec(schedule)
    S = costs.num_stages
    if not spec.fits(S, num_ranks):
        return None
    try:
        order = _order(spec.name, num_ranks, m, S // num_ranks)
    except ValueError:
        return None
    batch = costs.batch * scale
    table, work, held, kept = _stage_inputs(costs, ac, spec.split_backward, scale, saved_only)
    latency = {link: comm.time(b * scale) for link, b in costs.link_bytes.items()}
    links = sorted({(s, d, True) for s, d in costs.link_bytes} | {(s, s + 1, True) for s in range(S - 1)})
    sim = simulate(order, table, links=links, comm_latency=latency, activation_bytes=held, workspace_bytes=work,
                   input_grad_bytes=kept)
    peak = _peak_bytes(order, costs, optimizer_state, sim)
    return Candidate(schedule=spec.name, stages_per_rank=S // num_ranks, split=costs, n_microbatches=m,
                     microbatch_size=max(1, round(batch)),
                     activation_checkpoint=ac, step_time=sim.makespan, peak_bytes=peak,
                     bubble=sim.bubble_fraction, fits=max(peak.values()) <= budget, simulation=sim)


def _stage_inputs(costs: SplitCosts, ac: bool, split_backward: bool, scale: float, saved_only: bool
                  ) -> tuple[dict[tuple[int, str], float], dict[tuple[int, str], float], list[float], list[float]]:
    """:func:`simulate`'s inputs for one candidate's stages at ``scale`` x the example microbatch:
    per (stage, kind) the action's seconds and the bytes a backward adds while it runs; per
    stage the bytes a microbatch holds from F, and keeps from I until W."""
    batch = costs.batch * scale
    measured = costs.measured if costs.measured is not None and costs.measured.has(ac, split_backward) else None
    table: dict[tuple[int, str], float] = {}
    held, kept = [], []
    work: dict[tuple[int, str], float] = {}
    for s, st in enumerate(costs.stages):
        if measured is not None:
            ms = measured.stage(ac=ac, split_backward=split_backward, stage=s)
            for kind in ms.kinds:
                table[(s, kind)] = ms.time(kind, batch)
            work[(s, "B")], work[(s, "I")] = ms.work_bytes * batch, ms.input_work_bytes * batch
            retained = ms.retained_bytes * batch if split_backward else 0.0
        else:
            f, i, w = st.times(scale)
            extra = f if ac else 0.0  # the forward re-runs right before the backward
            table[(s, "F")], table[(s, "I")], table[(s, "W")] = f, i + extra, w
            table[(s, "B")] = i + w + extra
            # checkpointed: B rebuilds the stage's graph (what autograd saves, beyond the kept
            # inputs) and frees it; I rebuilds it and leaves it for W
            rebuilt = (st.held_bytes - st.boundary_bytes) * scale if ac else 0.0
            work[(s, "B")], work[(s, "I")] = rebuilt, 0.0
            retained = rebuilt if split_backward else 0.0
        boundary = 0.0 if saved_only else st.boundary_bytes * scale
        held.append(boundary if ac else st.held_bytes * scale)
        # a split backward keeps W's output gradients (and, checkpointed, the rebuilt graph) from I until W
        grads = st.wgrad_bytes * scale if split_backward and not saved_only else 0.0
        kept.append(grads + retained)
    return table, work, held, kept


def _peak_bytes(order: Order, costs: SplitCosts, optimizer_state: float, sim: Simulation) -> dict[int, float]:
    """Per rank, its stages' weights, gradients and optimizer state plus the simulated peak
    of held activations."""
    where = placement_of_order(order)
    static = {r: 0.0 for r in order}
    for s, st in enumerate(costs.stages):
        static[where[s]] += st.param_bytes * (2.0 + optimizer_state)  # weights, grads, optimizer state
    return {r: static[r] + (sim.peak_bytes or {}).get(r, 0.0) for r in order}


@functools.lru_cache(maxsize=512)  # an order depends on the sizes only, not on the split or costs
def _order(name: str, p: int, m: int, spr: int) -> Any:
    from ..schedule import get_schedule_class

    return get_schedule_class(name).compute_order(p, m, spr)
