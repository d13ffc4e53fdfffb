"""Looped breadth-first (BFS): each local stage runs all microbatches before
the next one; backwards run the stages in reverse, newest microbatch first.

Paper: Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023.

Placement: ``"loop"``, any ``stages_per_rank >= 1`` (rank ``r`` holds stages
``r, r + p, r + 2p, ...``). With one stage per rank it is GPipe. Breadth-first
order keeps each stage's weights busy for ``m`` microbatches in a row (good
for sharded data parallel), at the cost of holding ``v * m`` activations.

p=2, 2 stages/rank (stages 0,2 on rank 0; 1,3 on rank 1), m=2, F=1, B=2;
``'`` marks the second local stage::

    rank 0  F0  F1  F0' F1' .   .   .   B1' B1' B0' B0' B1  B1  B0  B0
    rank 1  .   F0  F1  F0' F1' B1' B1' B0' B0' B1  B1  B0  B0
"""

from __future__ import annotations

from ..actions import Order
from ..placement import Style
from .common import Action, B, F, check_sizes, local_stages

__all__ = ["compute_order"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "loop"
STAGES_PER_RANK: int | None = None  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 1
SPLIT_BACKWARD = False  # whether the order uses I and W
PAPER = "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism"


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Order:
    """Looped BFS order: per stage all forwards, then per stage (reversed) all backwards.

    Example:
        >>> [str(a) for a in compute_order(2, 2, 2)[1]]
        ['1F0', '1F1', '3F0', '3F1', '3B1', '3B0', '1B1', '1B0']
    """
    check_sizes("LoopedBFS", num_ranks, n_microbatches, stages_per_rank)
    mbs = range(n_microbatches)
    order: Order = {}
    for rank, stages in local_stages(num_ranks, stages_per_rank, PLACEMENT).items():
        fwd: list[Action | None] = [Action(s, F, mb) for s in stages for mb in mbs]
        bwd: list[Action | None] = [Action(s, B, mb) for s in reversed(stages) for mb in reversed(mbs)]
        order[rank] = fwd + bwd
    return order
