"""What a schedule runs, decided once when it is built: :class:`SchedulePlan`.

Part of the schedule layer, between the order families (:mod:`.orders`) and the schedule
classes: a family's compute order for the stage count, rank count and microbatches, moved
to another placement where asked (:mod:`.placement`), lowered with the split's links
(:mod:`.lower`) and checked (:mod:`.validate`): pure data, no process group, no stage.
A :class:`~.pipeline_schedule.PipelineSchedule` builds one and runs its actions on the
:class:`~.runtime.Interpreter`.

Example:
    >>> plan = SchedulePlan.of_family("ZBVZeroBubble", num_stages=4, world=2, n_microbatches=4,
    ...                               links=[(0, 1, True), (1, 2, True), (2, 3, True)], owner="example")
    >>> plan.placement, plan.splits_backward
    ({0: 0, 1: 1, 2: 1, 3: 0}, True)
    >>> [str(a) for a in plan.forward_only(rank=1, n=1)]
    ['1RECV_F0', '1F0', '2F0', '2SEND_F0']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..stage.groups import PipelineGroup
from ..stage.stage import PipelineStage
from .actions import Action, ActionKind, Order
from .collectives import gather_links
from .deps import Link, edge_links
from .errors import ScheduleError
from .lower import lower
from .orders import get_order_spec
from .placement import placement_of_order, replace_placement
from .validate import validate

__all__ = ["SchedulePlan", "stage_links"]


@dataclass(frozen=True)
class SchedulePlan:
    """A schedule's order (as generated or given), lowered and validated, and its placement."""

    order: Order
    """The compute order (or the order given, when it was already lowered)."""
    lowered: Order
    """``order`` with its SEND/RECV actions, checked under NCCL's batch rule."""
    placement: dict[int, int]
    """``{stage: rank}``."""
    links: list[Link]
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def splits_backward(self) -> bool:
        """Whether the order runs backward as I and W (zero-bubble families)."""
        return any(a is not None and a.kind in (ActionKind.I, ActionKind.W) for acts in self.order.values()
                   for a in acts)

    def check_holds(self, rank: int, stages: Sequence[int], owner: str) -> None:
        """Refuse, naming the stages this rank should hold, a rank given a stage placed elsewhere."""
        for s in stages:
            if self.placement.get(s) != rank:
                mine = sorted(t for t, r in self.placement.items() if r == rank)
                raise ValueError(f"{owner}: stage {s} belongs on rank {self.placement.get(s)}, not rank {rank}; "
                                 f"this rank should hold stages {mine}")

    def actions(self, rank: int) -> list[Action]:
        """What ``rank`` runs in a training step."""
        return [a for a in self.lowered.get(rank, []) if a is not None]

    def forward_only(self, rank: int, n: int) -> list[Action]:
        """What ``rank`` runs in a forward-only step of ``n`` microbatches (``eval()``):
        stage-major forwards, which any placement runs."""
        world = 1 + max(self.placement.values())
        order: Order = {r: [Action(s, ActionKind.F, mb) for s in sorted(self.placement) if self.placement[s] == r
                            for mb in range(n)] for r in range(world)}
        return [a for a in lower(order, self.links, self.placement)[rank] if a is not None]

    @classmethod
    def of_family(cls, order_name: str, *, num_stages: int, world: int, n_microbatches: int, links: Sequence[Link],
                  owner: str, stages_per_rank: int | None = None, placement: str | None = None,
                  held: Sequence[int] | None = None) -> SchedulePlan:
        """The family's order for these sizes; ``placement`` (``"loop"`` / ``"v"``) moves it
        to another placement, checked. ``held``: this rank's stages, checked against the
        family's rule (``owner`` names the schedule class in errors)."""
        spec = get_order_spec(order_name)
        per_rank = stages_per_rank or max(1, num_stages // max(1, world))
        if held is not None:
            spec.check_stages(owner, list(held), num_stages, world)
        order = spec.compute_order(world, n_microbatches, per_rank)
        style = placement or spec.placement
        if style != spec.placement:
            order = replace_placement(order, num_stages, world, spec.placement, style)
            try:
                validate(order, num_stages, n_microbatches, links=list(links))
            except ScheduleError as e:
                raise ScheduleError(f"{owner}'s order does not run under {style!r} placement: {e.reason}",
                                    rank=e.rank, step=e.step, action=e.action) from e
        return cls.of_order(order, spec.stage_placement(num_stages, world, style), n_microbatches, links)

    @classmethod
    def of_order(cls, order: Order, placement: dict[int, int] | None, n_microbatches: int,
                 links: Sequence[Link]) -> SchedulePlan:
        """A given order (compute-only or already lowered); ``placement`` None: read off the order."""
        where = placement if placement is not None else placement_of_order(order)
        num_stages = len(where)
        given_lowered = any(a is not None and a.kind.is_comm for acts in order.values() for a in acts)
        if placement is None and not given_lowered:
            validate(order, num_stages, n_microbatches, links=list(links))
        lowered = order if given_lowered else lower(order, list(links), where)
        validate(lowered, num_stages, n_microbatches, links=list(links), placement=where)
        return cls(order, lowered, where, list(links), n_microbatches)


def stage_links(stages: Sequence[PipelineStage], group: PipelineGroup) -> list[Link]:
    """The split's ``(src, dst, carries_grad)`` links: read off the Pipe the stages were built
    from, or (hand-built stages) gathered from every rank's stages (a collective)."""
    pipe = stages[0].pipe
    if pipe is not None:
        return edge_links(pipe.edges)
    return gather_links([link for st in stages for link in st.links()], group)
