"""ZB-V: zero bubble on a V placement, two stages per rank.

Paper: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024
(arXiv:2401.10241), section 6 ("ZB-V").

Placement: ``"v"``, exactly 2 stages per rank: rank ``r`` holds stages ``r``
and ``2p - 1 - r``, so the first and the last stage share rank 0 and the loss
gradient turns around without a hop. Memory is 1F1B's peak: at most ``2p``
half-size stage activations per rank. The order comes from :mod:`.greedy`
(F and I alternate under the memory cap, ``W`` fills the gaps); with F=I=W and
``m >= 2p`` the steady state has no bubble.

p=2 (stages 0,3 on rank 0; 1,2 on rank 1), m=2, F=I=W=1; ``'`` marks chunk 1
(stages 2 and 3)::

    rank 0  F0  F1  .   F0' I0' F1' I1' I0  W0' I1  W1' W0  W1
    rank 1  .   F0  F0' F1  F1' I0' I0  I1' I1  W0' W0  W1' W1
"""

from __future__ import annotations

from ..actions import Order
from ..placement import stage_to_rank
from .common import check_sizes
from .greedy import best_greedy_order

__all__ = ["compute_order"]


def compute_order(num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Order:
    """ZB-V order (F, I, W actions) on V placement.

    Example:
        >>> [str(a) for a in compute_order(1, 1)[0]]
        ['0F0', '1F0', '1I0', '0I0', '1W0', '0W0']
    """
    check_sizes("ZBVZeroBubble", num_ranks, n_microbatches, stages_per_rank, exact_stages=2)
    placement = stage_to_rank(2 * num_ranks, num_ranks, "v")
    variants = [(None, True), (None, False)]  # with and without strict F/I alternation
    return best_greedy_order(placement, num_ranks, n_microbatches, [2 * num_ranks] * num_ranks, variants)
