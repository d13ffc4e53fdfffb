"""GPipe: every forward, then every backward.

Paper: Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
Pipeline Parallelism", NeurIPS 2019.

Placement: ``"loop"``, one stage per rank (stage ``r`` on rank ``r``).
Each rank keeps all ``m`` activations alive until its backwards start.

p=2, m=3, unit costs (F=1, B=2); digits are microbatches, ``.`` is idle::

    rank 0  F0  F1  F2  .   .   .   B0  B0  B1  B1  B2  B2
    rank 1  .   F0  F1  F2  B0  B0  B1  B1  B2  B2
"""

from __future__ import annotations

from itertools import repeat

from ..actions import Order
from ..placement import Style
from .common import Action, B, F, actions_of, check_sizes, gc_paused, local_stages

__all__ = ["compute_order"]

# What this family needs, as data (read by the registry in orders/__init__.py):
PLACEMENT: Style = "loop"
STAGES_PER_RANK: int | None = 1  # None: any count >= MIN_STAGES_PER_RANK
MIN_STAGES_PER_RANK = 1
SPLIT_BACKWARD = False  # whether the order uses I and W
PAPER = "Huang et al. 2019, GPipe (NeurIPS)"


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Order:
    """GPipe order: ``F0..F(m-1)`` then ``B0..B(m-1)`` on every rank.

    Example:
        >>> [str(a) for a in compute_order(2, 2)[1]]
        ['1F0', '1F1', '1B0', '1B1']
    """
    check_sizes("GPipe", num_ranks, n_microbatches, stages_per_rank, exact_stages=1)
    mbs = range(n_microbatches)
    order: Order = {}
    for r, (stage,) in local_stages(num_ranks, stages_per_rank, PLACEMENT).items():
        with gc_paused():
                ops: list[Action | None] = list(actions_of(repeat(stage), [F] * len(mbs) + [B] * len(mbs),
                                                       [*mbs, *mbs], 2 * len(mbs)))
        order[r] = ops
    return order
